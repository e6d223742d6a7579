"""What a sandboxed program sees of the filesystem in its namespaces, worked out here in
the trusted parent once per interpreter; the launcher builds it as a new root holding
nothing else (``launcher.build_root``).

The program needs its interpreter, the directories of its module path (run with ``-I -S``:
the standard library and its extension modules), the directories of the shared libraries
these load (as ``ldd`` names them) and ``setpriv``, which drops capabilities before the
interpreter starts; and reads, where present, ``/etc/ld.so.cache`` (where the loader finds
libraries), ``/etc/localtime`` and ``/usr/share/zoneinfo`` (local time, ``zoneinfo``) and
the ``C.UTF-8`` locale its environment names. Measured with ``strace -f`` on the code
reward's harness and ``tests/helpers/sandbox.TYPICAL_PROGRAM``. Every site-packages
directory inside these is hidden under an empty tmpfs: an installed package's source (this
package's code tasks among them) lives there. Symbolic links met on the way to a path (``/lib
-> usr/lib``) are repeated in the new root, so every path means what it means on the host.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess

from lightning_logra.sandbox.isolation import SandboxUnavailable

READ_WHERE_PRESENT = ["/etc/ld.so.cache", "/etc/localtime", "/usr/share/zoneinfo", "/usr/lib/locale/C.utf8"]
# What the interpreter says of itself, run the way it runs programs.
QUERY = ("import json, site, sys, sysconfig\n"
         "print(json.dumps({'path': sys.path, 'site': [*site.getsitepackages(), sysconfig.get_path('purelib'), "
         "sysconfig.get_path('platlib')]}))")
LIBRARY = re.compile(r"(/\S+) \(0x[0-9a-f]+\)")  # "libc.so.6 => /lib/.../libc.so.6 (0x...)", "/lib64/ld-... (0x...)"
MAX_LINKS = 40  # as the kernel's ELOOP


@functools.cache
def filesystem(interpreter: str, setpriv: str) -> dict[str, list]:
    """The view for programs run by ``interpreter``: ``binds`` (real paths, shown
    read-only at the same path), ``links`` ([path, target] to repeat) and ``hidden``
    (site-packages directories inside a bound one). Raises ``SandboxUnavailable`` when the
    interpreter cannot say where its library is, or ``ldd`` is missing."""
    try:
        answer = subprocess.run([interpreter, "-I", "-S", "-c", QUERY], capture_output=True, text=True, env={},
                                timeout=60, check=True)
        described = json.loads(answer.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        raise SandboxUnavailable(f"the sandbox could not ask {interpreter} where its standard library is: "
                                 f"{type(error).__name__}: {error}") from None
    links: dict[str, str] = {}
    module_path = [entry for entry in described["path"] if os.path.isabs(entry) and os.path.exists(entry)]
    binds = {_resolve(path, links) for path in [interpreter, setpriv, *module_path]}
    extensions = [os.path.join(folder, name) for folder in module_path if os.path.isdir(folder)
                  for name in sorted(os.listdir(folder)) if name.endswith(".so")]
    for library in _libraries([interpreter, setpriv, *extensions]):
        binds.add(os.path.dirname(_resolve(library, links)))
    binds |= {_resolve(path, links) for path in READ_WHERE_PRESENT if os.path.exists(path)}
    binds = {path for path in binds if not _inside_any(path, binds - {path})}
    hidden = {os.path.realpath(path) for path in described["site"] if os.path.isdir(path)}
    return {"binds": sorted(binds),
            "links": sorted([path, target] for path, target in links.items() if not _inside_any(path, binds)),
            "hidden": sorted(path for path in hidden if _inside_any(path, binds) or path in binds)}


def _libraries(files: list[str]) -> list[str]:
    """The shared libraries ``files`` load, as the loader finds them (``ldd``)."""
    ldd = shutil.which("ldd", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if ldd is None:
        raise SandboxUnavailable("the sandbox needs `ldd` (the C library's tools) to find the shared libraries "
                                 "the interpreter loads")
    # ldd exits non-zero when one of the files is not dynamic; what it lists still holds.
    listing = subprocess.run([ldd, *files], capture_output=True, text=True, env={}, timeout=60).stdout
    return sorted({found[1] for found in LIBRARY.finditer(listing)})


def _resolve(path: str, links: dict[str, str]) -> str:
    """The real path of ``path``, adding each symbolic link met on the way to ``links``."""
    for _ in range(MAX_LINKS):
        current, parts = "/", [part for part in path.split("/") if part]
        for index, part in enumerate(parts):
            candidate = os.path.join(current, part)
            if os.path.islink(candidate):
                links[candidate] = os.readlink(candidate)
                # `current` is real, so `..` in the target (or the rest) is its lexical parent.
                path = os.path.normpath(os.path.join(current, links[candidate], *parts[index + 1:]))
                break
            current = candidate
        else:
            return current
    raise SandboxUnavailable(f"the sandbox could not resolve {path}: more than {MAX_LINKS} symbolic links")


def _inside_any(path: str, folders: set[str]) -> bool:
    return any(path.startswith(folder.rstrip("/") + "/") for folder in folders)
