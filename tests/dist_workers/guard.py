"""Bound a worker's lifetime: it exits by itself at its deadline or when its launcher dies."""

import faulthandler
import os
import threading
import time
from pathlib import Path


def bound_lifetime(seconds, workdir):
    """Call first thing in a worker: record the pid for the launcher and arm two exits.

    After ``seconds`` the worker prints every thread's stack and exits (even if blocked inside
    a collective), and it exits at once if its parent process goes away. The pid file lets the
    launcher kill the worker's process group even if the worker started its own session.
    """
    Path(workdir, "pids").mkdir(parents=True, exist_ok=True)
    if os.getpgid(0) == os.getpid():
        Path(workdir, "pids", f"{os.getpid()}.pid").write_text("")
    faulthandler.dump_traceback_later(seconds, exit=True)
    parent = os.getppid()

    def watch_parent():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch_parent, daemon=True).start()
