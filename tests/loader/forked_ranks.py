"""Start the ranks of a rank script as torchrun does, for a fraction of its CPU time.

    python -m tests.loader.forked_ranks NPROC MODULE ARGS... [-- NPROC MODULE ARGS...]...

torchrun starts each rank (and itself) as a fresh interpreter that imports torch, ~3 CPU-seconds
apiece. Here one interpreter imports torch and MODULE once and forks the NPROC ranks, which call
MODULE.main(*ARGS). As under torchrun, the launcher hosts the store the ranks rendezvous
through (TORCHELASTIC_USE_AGENT_STORE), so the store outlives any rank, and each rank gets
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, ...). The ranks are
forked before the store's thread starts; each learns the store's port through a pipe.
Runs separated by `--` follow one another (a job resumed by another number of ranks, or
independent jobs that share the one import), each with its own ranks and store; each run's
output follows a line `RUN_HEADER` + its number (see run_logs).

Exits 0 when every rank of every run exited 0, else 1; a rank that did not is named in its
run's output.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import traceback
from datetime import timedelta

import torch.distributed as dist

RUN_HEADER = "== forked_ranks run "


def run_logs(output: str) -> list[str]:
    """The launcher's output split by run (what its ranks printed and logged, in run order)."""
    return [part.split("\n", 1)[-1] for part in output.split(RUN_HEADER)[1:]]


def launcher_output(command: list[str], timeout: float) -> str:
    """Run a launcher COMMAND to its end, one thread per rank as torchrun sets: its output (the
    ranks' too); past `timeout` seconds it and its ranks are killed and the output so far returned."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0] + f"\nforked_ranks: killed after {timeout} s"


def run_rank(script, args: list[str], env: dict[str, str], port_pipe: int) -> int:
    port = os.read(port_pipe, 16).decode()
    os.close(port_pipe)
    os.environ.update(env, MASTER_PORT=port)
    try:
        script.main(*args)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception, then the exit status says it
        traceback.print_exc()
        return 1
    return 0


def launch(nproc: int, module: str, args: list[str]) -> int:
    script = importlib.import_module(module)
    ranks: dict[int, int] = {}  # pid -> rank
    pipes = []
    for rank in range(nproc):
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank: never returns into the launcher's code
            code = 1
            try:
                os.close(write)
                for other in pipes:
                    os.close(other)
                code = run_rank(script, args, env, read)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(read)
        ranks[pid] = rank
        pipes.append(write)
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size=None,
        is_master=True,
        timeout=timedelta(seconds=300),
        wait_for_workers=False,
    )
    for write in pipes:
        os.write(write, str(store.port).encode())
        os.close(write)
    failed = []
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failed.append(rank)
            how = f"signal {-code}" if code < 0 else f"exit status {code}"
            print(f"forked_ranks: rank {rank} (pid {pid}) ended with {how}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    runs, run = [], []
    for word in argv + ["--"]:
        if word != "--":
            run.append(word)
        elif run:
            runs.append(run)
            run = []
    failed = False
    for number, (nproc, module, *args) in enumerate(runs):
        print(f"{RUN_HEADER}{number}: {nproc} ranks of {module} {' '.join(args)}", flush=True)
        failed |= launch(int(nproc), module, args) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
