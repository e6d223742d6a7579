"""Checkpoint folders of the ``logra_fsdp`` strategies: their layout (``folder``: DCP shards
and Lightning's metadata; ``logra_state``: LoGRA's state file), atomic writes and recovery
after a crash (``atomic``; ``recovery`` at a Trainer's start-up), one writer per folder
(``writer_lock``), and what a strategy class adds for them (``strategy``)."""
