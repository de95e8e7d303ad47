"""Start worker processes with a deadline and kill every process they started, whatever happens."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class WorkersFailed(AssertionError):
    """The workers exited with an error or ran past their deadline; carries their output."""


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    >>> 1024 <= free_port() <= 65535
    True
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(**extra):
    """Environment for a worker: the repo importable, one thread per process, loopback only."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    env.update({key: str(value) for key, value in extra.items()})
    return env


def torchrun_command(module, nprocs, *args):
    """``torchrun`` (as ``python -m torch.distributed.run``) for ``module`` on 127.0.0.1 and a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nprocs),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.2",
            "-m", module, *map(str, args)]


def run_bounded(command, *, env, timeout, workdir):
    """Run ``command`` in its own session and return its output; kill everything it started on exit.

    Workers that detach into their own sessions (torchrun starts each rank that way) record their
    pid in ``workdir/pids`` through ``guard.bound_lifetime``; those process groups are killed
    too, on success, failure, timeout or an interrupt of the test itself.

    Raises:
        WorkersFailed: non-zero exit status or ``timeout`` seconds passed; the message holds the
            command's output.
    """
    workdir = Path(workdir)
    (workdir / "pids").mkdir(parents=True, exist_ok=True)
    log_path = workdir / "output.log"
    with open(log_path, "wb") as log:
        command = [str(part) for part in command]
        proc = subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            kill_started(proc, workdir / "pids")
    output = log_path.read_text(errors="replace")
    if returncode is None:
        raise WorkersFailed(f"{' '.join(command)}\nran past its {timeout} s deadline and was killed; output:\n{output}")
    if returncode != 0:
        raise WorkersFailed(f"{' '.join(command)}\nexited with status {returncode}; output:\n{output}")
    return output


def kill_started(proc, pid_dir):
    """SIGKILL the process group of ``proc`` and of every worker listed in ``pid_dir``, then reap."""
    groups = [proc.pid] + [int(path.stem) for path in Path(pid_dir).glob("*.pid")]
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # already gone
    proc.wait()


def alive(pid):
    """Whether a process with this pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
