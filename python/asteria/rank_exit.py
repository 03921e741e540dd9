"""How a rank process ends: ``exit_rank(code)``, the one epilogue of every multi-process worker
of ours (tests, benchmarks, examples), and a call a user's launcher script may make too.

Why: a process that ran gloo collectives can abort in the interpreter's finalization with
"terminate called without an active exception" (SIGABRT) even after ``destroy_process_group()``:
gloo's C++ threads and work objects are torn down while the interpreter is, in no fixed order
(pytorch/pytorch#190489). What the rank computed is already written by then, but its exit code
says 134, and a test or a launcher that reads the code reports a failure that is a race.
``exit_rank`` ends the process the way a normal exit would up to that point, then skips it:

1. with ``teardown`` (the default), destroys every process group still alive (after a failure a
   peer may be gone and a collective teardown could wait for it: pass ``teardown=False``);
2. runs the ``atexit`` handlers, as a normal exit does: among them the finalizers of Asteria's
   optimizers still open, which close their runtimes (worker threads joined, NVMe files
   removed), and multiprocessing's and logging's;
3. flushes stdout and stderr, then ``os._exit(code)``: no interpreter finalization, no C++
   static destructors.

Owns nothing. May call: torch.distributed (destroy only), atexit, os, sys. Call it from the
process's main thread, with nothing of the process's own work still running.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_rank(code: int = 0, *, teardown: bool = True) -> NoReturn:
    """End this process with exit status ``code`` without the interpreter's finalization (the
    module docstring says why and what runs first). ``teardown=False`` skips destroying the
    process groups: for a rank whose peers may be gone."""
    if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code <= 255:
        raise ValueError(f"exit_rank: code must be an int in [0, 255], got {code!r}")
    try:
        if teardown:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        atexit._run_exitfuncs()  # noqa: SLF001 - what a normal exit runs first, and only that
    except BaseException:  # a teardown that fails is the rank's failure: say so, exit non-zero
        import traceback

        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: the exit code still goes out
            pass
    os._exit(code)
