"""The engine process's tie to its parent (the frontend): it never outlives it.

```
parent dies ─▶ Linux: PR_SET_PDEATHSIG delivers SIGTERM at once
            └▶ anywhere: the watchdog thread sees the parent pid change within PARENT_POLL_S
               ─▶ SIGTERM to itself; still alive HARD_EXIT_S later ─▶ IPC dir removed, _exit
SIGTERM ─▶ parent gone or engine not serving yet ─▶ EngineExit now (exit 0, IPC dir removed
                                                    if the parent is gone)
        └▶ parent alive and serving ─▶ keep serving at most sigterm_grace_s: the frontend owns
           the drain, and a SIGTERM sent to the whole process group must not cut it short
SIGINT (Ctrl-C reaches the whole group) ─▶ ignored, for the same reason
```

Nothing here relies on the parent's cleanup: a SIGKILLed frontend leaves no engine and no IPC
directory behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any, Optional

PARENT_POLL_S = 0.5
"""How often the watchdog thread checks that the parent is alive."""

HARD_EXIT_S = 5.0
"""After the parent is gone: how long the main thread gets to exit cleanly (it may be inside a
long native call) before the watchdog ends the process itself."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class EngineExit(BaseException):
    """Unwinds the engine's main thread on SIGTERM or parent death (a clean exit, code 0).

    A BaseException so that no `except Exception` inside a step swallows it."""


def _set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send `sig` when the parent exits; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class ParentGuard:
    """Signal handling and parent watching of the engine process; `install()` once, early.

    Args:
        parent_pid: the frontend's pid (passed in: by the time the child runs, `getppid()` may
            already name a reaper).
        ipc_dir: the sockets' directory, removed when the parent is gone (nobody else will).
        sigterm_grace_s: see the module docstring.
    """

    def __init__(self, parent_pid: int, ipc_dir: Optional[str], sigterm_grace_s: float) -> None:
        self.parent_pid = parent_pid
        self.ipc_dir = ipc_dir
        self.sigterm_grace_s = sigterm_grace_s
        self.serving = False
        """Set once the engine is ready; before that a SIGTERM exits at once."""
        self._term_deadline: Optional[float] = None
        self._exiting = False

    def install(self) -> None:
        """Signal handlers, the parent-death signal and the watchdog thread.

        Raises:
            EngineExit: the parent died before the parent-death signal was armed.
        """
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        _set_parent_death_signal(signal.SIGTERM)
        if self.parent_gone():  # it died before prctl: no signal will ever come
            raise EngineExit("parent process gone")
        threading.Thread(target=self._watch, name="tinyvllm-parent-watchdog", daemon=True).start()

    def parent_gone(self) -> bool:
        return os.getppid() != self.parent_pid

    def should_exit(self) -> bool:
        """Polled by the engine loop: the parent is gone or a SIGTERM's grace has run out."""
        if self.parent_gone():
            return True
        return self._term_deadline is not None and time.monotonic() > self._term_deadline

    def exiting(self) -> None:
        """The main thread is cleaning up: further SIGTERMs must not interrupt it."""
        self._exiting = True

    def cleanup_if_orphaned(self) -> None:
        if self.ipc_dir and self.parent_gone():
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._exiting:
            return
        if self.parent_gone() or not self.serving:
            self._exiting = True  # once: a second signal must not interrupt the unwinding
            raise EngineExit("SIGTERM" + (" after the parent died" if self.parent_gone() else ""))
        if self._term_deadline is None:
            self._term_deadline = time.monotonic() + self.sigterm_grace_s
            print(f"tinyvllm engine core: SIGTERM while the frontend lives; serving at most "
                  f"{self.sigterm_grace_s:.0f}s more", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        while not self.parent_gone():
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)  # lets the main thread unwind cleanly
        time.sleep(HARD_EXIT_S)
        # Still here: the main thread is stuck (a native call, a blocked send). End it.
        print("tinyvllm engine core: parent gone and the main thread did not exit; exiting",
              file=sys.stderr, flush=True)
        self.cleanup_if_orphaned()
        os._exit(0)
