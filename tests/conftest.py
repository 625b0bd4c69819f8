"""Shared helpers: run the real CLIs as subprocesses (Lightning's ddp re-executes sys.argv, so never in-process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from forkserver import ForkedRun, ForkServer

from parallama.runtime.launch import use_private_torch_extensions

use_private_torch_extensions()  # one DeepSpeed op build for the whole suite, whatever HOME a test sets
# One thread per test process: 2 workers share 2 cores, and torch's second thread only spins waiting for the other
# worker's core (tests/unit: 228 s of CPU for 302 s with two, 2m03s for 2m39s on the 2-core CI machine). The runs
# the tests start set their own (OMP_NUM_THREADS=1 below, or parallama's launcher sharing out the cores).
torch.set_num_threads(1)
# One matplotlib font cache too (torchmetrics imports matplotlib): a test's fresh HOME would otherwise have every
# process of that test build it again (~5 s each).
os.environ.setdefault("MPLCONFIGDIR", str(Path(tempfile.gettempdir()) / "parallama-tests-matplotlib"))

# A model and run small enough for a 2-core CPU: a few steps of a 2-layer, 64-wide Llama on 12 documents.
# Everything else stays at its default (warmup, validation before training, the sample at the end).
TINY = [
    "trainer.accelerator=cpu",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.seq_len=64",
    "data.source.max_documents=12",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=2",
    "sample.max_new_tokens=16",
]


@pytest.fixture
def no_wandb_account(tmp_path, monkeypatch):
    """A HOME without `wandb login`'s netrc: W&B must pick offline mode by itself, and nothing touches ~."""
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for key in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(key, raising=False)


# Set by launchers (an in-process ddp_spawn run leaves them in os.environ); a test's runs start without them.
LAUNCH_ENV = ("WANDB_", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


_SERVER_ENV = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_ENV)}
_SERVER_ENV.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
_fork_server: ForkServer | None = None


def run_cli(
    module: str,
    *args: str,
    cwd: Path,
    timeout: int = 300,
    check: bool = True,
    env: dict | None = None,
    fresh: bool | str = False,
) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` in its own process, forked from a server that has imported torch and
    Lightning already (tests/forkserver.py); `fresh` (or PARALLAMA_TEST_FORK=0): a fresh interpreter, whose
    ranks are fresh interpreters too; `fresh="parallama-train"`: that installed console script, as a user's
    shell runs it (its ranks then start the script again: launch.job_command)."""
    env = _run_env(cwd, env)
    if not fresh and forking():
        proc = fork_server().run(module, list(args), cwd=cwd, env=env, timeout=timeout)
    else:
        command = (
            [str(Path(sys.executable).parent / fresh)]
            if isinstance(fresh, str)
            else [sys.executable, "-m", module]
        )
        proc = subprocess.run(
            [*command, *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if check and proc.returncode != 0:
        output = proc.stdout + proc.stderr
        errors = [line for line in output.splitlines() if "error" in line.lower()][
            -5:
        ]  # first: CI logs get cut
        raise AssertionError(
            f"{module} exited {proc.returncode}; error lines: {errors}\nargs: {' '.join(args)}\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def start_cli(
    module: str, *args: str, cwd: Path, env: dict | None = None, fresh: bool = False
) -> ForkedRun | subprocess.Popen:
    """`python -m <module> <args>` started as `run_cli` runs it, without waiting for it (`poll`, `wait(timeout)`,
    `send_signal` as a Popen's): the leader of its own process group, its stderr into its stdout, which
    `output_of` reads (a file, so a chatty run never blocks on a full pipe). The fork server runs one run at a
    time: a test that runs others while this one lives starts it `fresh`."""
    env = _run_env(cwd, env)
    if not fresh and forking():
        return fork_server().start(module, list(args), cwd=cwd, env=env, merge_stderr=True)
    fd, path = tempfile.mkstemp(prefix="parallama-run-", suffix=".out")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        stdout=fd,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    os.close(fd)
    proc.output_file = Path(path)
    return proc


def output_of(proc: ForkedRun | subprocess.Popen) -> str:
    """What a `start_cli` run has written so far (all of it once it has ended)."""
    if isinstance(proc, ForkedRun):
        return proc.outputs()[0]
    return proc.output_file.read_text(errors="replace")


@pytest.fixture(autouse=True)
def no_forked_run_left_behind():
    """A test that ended (failed, say) while a `start_cli` run still works ends that run: the fork server runs one
    run at a time, and the next test's run would wait for it."""
    yield
    run = _fork_server.running if _fork_server is not None else None
    if run is not None and run.poll() is None:
        run.kill()


def forking() -> bool:
    return os.environ.get("PARALLAMA_TEST_FORK", "1") != "0"


def fork_server() -> ForkServer:
    global _fork_server
    _fork_server = _fork_server or ForkServer(_SERVER_ENV)
    return _fork_server


def _run_env(cwd: Path, env: dict | None) -> dict:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_ENV)}, **(env or {})}
    env.update(
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_DIR=str(cwd), WANDB_CONFIG_DIR=str(cwd / ".wandb")
    )
    return env


def train(
    *args: str, cwd: Path, cache: Path, run_dir: Path | None = None, **kwargs
) -> subprocess.CompletedProcess:
    extra = [f"paths.cache_dir={cache}"] + ([f"hydra.run.dir={run_dir}"] if run_dir else [])
    return run_cli("parallama.cli.train", *TINY, *extra, *args, cwd=cwd, **kwargs)


def layout_weights(
    run_dir: Path, *args: str, ranks: int, batch: int, cwd: Path, cache: Path, env: dict | None = None
) -> dict:
    """A run of `args` on `ranks` processes at per-rank micro-batch `batch` in `run_dir`, and its last.ckpt's
    weights through parallama-export: what a parity test compares with one process's."""
    from safetensors.torch import load_file

    from parallama.cli.export import main as export_hf

    train(*args, f"trainer.devices={ranks}", f"data.batch_size={batch}", cwd=cwd, cache=cache, run_dir=run_dir,
          env=env, timeout=600)  # fmt: skip
    export_hf([f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", f"out_dir={run_dir / 'hf'}"])
    return load_file(run_dir / "hf" / "model.safetensors")


def pytest_configure(config) -> None:
    """Bytecode for parallama and bench, written once before any test: where PYTHONDONTWRITEBYTECODE=1 (the CI
    machine) every process the suite starts would otherwise compile the modules it imports again (~0.15 s each,
    some 700 processes)."""
    import compileall

    if not hasattr(config, "workerinput"):  # the controller (or no xdist), before any worker starts
        root = Path(__file__).resolve().parents[1]
        for folder in (root / "src" / "parallama", root / "bench"):
            compileall.compile_dir(folder, quiet=1)


def pytest_sessionfinish(session) -> None:
    if _fork_server is not None:
        _fork_server.close()


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenized-corpus cache for the whole session (every run of the same data reuses it)."""
    return tmp_path_factory.mktemp("cache")


# What the shared run sets beyond TINY (test_cli.py reads each): log-file progress lines every 2 steps, a
# throughput window that fills within its 4 steps, last.ckpt every 3 steps and every second (both at once), in a
# directory whose path is longer than 80 columns.
SHARED_RUN = [
    "callbacks.progress_bar.line_every_n_steps=2",
    "callbacks.throughput.window_size=2",
    "callbacks.last_checkpoint.every_n_train_steps=3",
    "~callbacks.last_checkpoint.train_time_interval.minutes",
    "+callbacks.last_checkpoint.train_time_interval.seconds=1",
]


@dataclass(frozen=True)
class FinishedRun:
    dir: Path  # the run directory: read it, never write into it (copy it with shutil.copytree)
    output: str  # stdout + stderr of the run


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, data_cache) -> FinishedRun:
    """One finished TINY run (+ SHARED_RUN) for the whole session: every test that needs a fresh single-process
    run with the defaults reads this one instead of training its own; a test that resumes or writes into a run
    works on a copy."""
    tmp = tmp_path_factory.mktemp("tiny_run")
    run_dir = tmp / ("a-directory-name-long-enough-to-pass-eighty-columns-" * 2) / "run"
    proc = train(*SHARED_RUN, cwd=tmp, cache=data_cache, run_dir=run_dir)
    return FinishedRun(run_dir, proc.stdout + proc.stderr)


# Long runs (tests/integration/test_resume.py, tests/distributed/test_faults.py): validation off the critical path; periodic checkpoints every 3 optimizer steps; ~250 batches per epoch,
# so every stop below lands in the middle of the first epoch.
LONG = [
    "trainer.max_steps=40",
    "trainer.val_check_interval=1000",
    "callbacks.last_checkpoint.every_n_train_steps=3",
]


# A model built directly, without a training run (the lm-eval wrapper's tests): 2 layers, 32 wide, GQA.
SMALL_LLAMA = {
    "family": "llama",
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="module")
def one_rank_mesh(tmp_path_factory):
    """A 1-rank gloo process group for the test module, and the ParallelDims mesh on it (every dimension of size
    1): the DTensor code paths (tensor parallel plans, FSDP2) in the test's own process."""
    import torch.distributed as dist

    from parallama.distributed.dims import ParallelDims

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield ParallelDims().build_mesh("cpu")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights(ckpt) -> dict:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def one_cycle_rates(steps: int, **keywords) -> list[float]:
    """The LR torch's OneCycleLR (`keywords`: its own, besides total_steps) gives each of `steps` optimizer steps,
    on an optimizer of its own: what a run's `lr-AdamW/pg1` must log at steps 1..steps."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, total_steps=steps, **keywords)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def tree_digest(folder: Path) -> dict[str, tuple[str, float]]:
    """Every file under `folder`: its content's digest and its mtime (a refused run must touch nothing)."""
    import hashlib

    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def slurm():
    """A one-node SLURM cluster on this machine (tests/slurm/cluster.py), one per test run and shared by its
    xdist workers; os.environ gets its SLURM_CONF, so sbatch, srun and scontrol (also a job's) find it. Skips in
    one line where it cannot run (not installed: `make slurm` installs it as root)."""
    from slurm.cluster import shared_cluster, unavailable

    if why := unavailable():
        pytest.skip(why)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"  # the workers of one run share it
    with shared_cluster(Path(tempfile.gettempdir()) / f"parallama-slurm-{run}", str(os.getpid())) as cluster:
        os.environ.update(cluster.env)
        yield cluster
