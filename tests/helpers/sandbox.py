"""Checks that a sandboxed run left nothing behind: no process, no file."""

from __future__ import annotations

from pathlib import Path

import psutil


def processes_under(folder: Path) -> list[str]:
    """Processes whose command line or working directory names ``folder`` (every sandboxed
    process starts in a working directory made there, and the launcher's command line
    names it), described for an assertion message."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "cwd"]):
        cmdline, cwd = " ".join(process.info["cmdline"] or ()), process.info["cwd"] or ""
        if str(folder) in cmdline or cwd.startswith(str(folder)):
            found.append(f"{process.info['pid']}: {cmdline[:200]} (in {cwd})")
    return found


def files_under(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


# What a sandboxed program typically does (the seccomp allowlist was measured on it): threads,
# a thread pool, asyncio, time, maths, text, compression, sqlite in memory, files in its
# working directory, pipes, signals, recursion, tracebacks, stdin and ctypes.
TYPICAL_PROGRAM = """
import asyncio, base64, bz2, concurrent.futures, csv, datetime, decimal, fractions, gzip, hashlib, json, lzma, math
import mmap, os, pathlib, pickle, queue, random, re, secrets, selectors, shutil, signal, sqlite3, statistics
import tempfile, textwrap, threading, time, traceback, unicodedata, uuid, zlib, ctypes, sys

lock, counter = threading.Lock(), [0]
def bump():
    for _ in range(1000):
        with lock:
            counter[0] += 1
threads = [threading.Thread(target=bump) for _ in range(8)]
[thread.start() for thread in threads]
[thread.join() for thread in threads]
assert counter[0] == 8000
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    assert sum(pool.map(lambda x: x * x, range(100))) == 328350
work = queue.Queue()
work.put(1)
assert work.get(timeout=1) == 1
threading.Event().wait(0.01)
time.sleep(0.01); time.time(); time.perf_counter(); time.process_time(); time.thread_time()
time.strftime("%Y"); time.localtime(); datetime.datetime.now().astimezone(); datetime.date.today()
(math.factorial(50), math.isqrt(10**30), statistics.mean([1, 2, 3]), fractions.Fraction(1, 3),
 decimal.Decimal(1) / decimal.Decimal(7), random.random(), secrets.token_hex(8), os.urandom(8), uuid.uuid4(),
 hashlib.sha256(b"x").hexdigest(), hashlib.md5(b"x").hexdigest())
(re.sub(r"\\d+", "#", "a1b22"), json.dumps({"a": [1, 2]}), textwrap.wrap("a b c", 2), unicodedata.name("a"),
 base64.b64encode(b"x"), zlib.compress(b"x" * 100), gzip.compress(b"x"), bz2.compress(b"x"), lzma.compress(b"x"),
 pickle.loads(pickle.dumps({1: 2})))
database = sqlite3.connect(":memory:")
database.execute("create table t (x)")
database.execute("insert into t values (1)")
assert database.execute("select sum(x) from t").fetchone() == (1,)
database.close()
pathlib.Path("a.txt").write_text("hello")
os.makedirs("d/e", exist_ok=True)
open("d/e/f.txt", "w").write("x")
shutil.copy2("a.txt", "d/b.txt"); shutil.copy("a.txt", "d/c.txt"); os.rename("d/c.txt", "d/c2.txt")
os.chmod("a.txt", 0o600); os.utime("a.txt"); os.stat("a.txt"); os.access("a.txt", os.R_OK)
sorted(os.listdir(".")); list(pathlib.Path(".").rglob("*.txt")); list(os.walk("."))
os.symlink("a.txt", "link.txt"); os.readlink("link.txt"); os.link("a.txt", "hard.txt"); os.truncate("hard.txt", 1)
with tempfile.TemporaryDirectory() as scratch, tempfile.NamedTemporaryFile("w") as named:
    named.write("x")
    named.flush()
    os.fsync(named.fileno())
with open("rw.bin", "w+b") as mapped_file:
    mapped_file.write(b"0" * 4096)
    mapped_file.flush()
    mapped = mmap.mmap(mapped_file.fileno(), 4096)
    mapped[0:1] = b"1"
    mapped.flush()
    mapped.close()
with open("data.csv", "w", newline="") as table:
    csv.writer(table).writerow([1, 2])
shutil.rmtree("d"); os.remove("a.txt"); os.unlink("link.txt"); os.getcwd(); os.statvfs(".")
os.cpu_count(); len(os.sched_getaffinity(0)); os.getpid(); os.getppid(); os.getuid(); os.uname(); os.umask(0o22)
read_end, write_end = os.pipe()
os.write(write_end, b"x")
with selectors.DefaultSelector() as selector:
    selector.register(read_end, selectors.EVENT_READ)
    assert selector.select(1)
assert os.read(read_end, 1) == b"x"
fired = []
signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
signal.setitimer(signal.ITIMER_REAL, 0.01)
time.sleep(0.2)
assert fired
async def square(n):
    await asyncio.sleep(0.001)
    return n * n
async def main():
    return await asyncio.wait_for(asyncio.gather(*(square(i) for i in range(5))), 5)
assert asyncio.run(main()) == [0, 1, 4, 9, 16]
sys.setrecursionlimit(5000)
def depth(n):
    return 0 if n == 0 else 1 + depth(n - 1)
assert depth(3000) == 3000
try:
    1 / 0
except ZeroDivisionError:
    assert "ZeroDivisionError" in traceback.format_exc()
assert sys.stdin.read() == ""
ctypes.CDLL(None).getpid()
print("typical ok")
"""
