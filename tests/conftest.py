from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# No test may reach the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
# The repository's script folders: a script run as `python recipes/simcse.py` or `python eval/sts.py` imports the
# modules of its own folder (recipe_tools, sts_tasks) by their plain names, since Python puts a script's folder on
# sys.path; the tests import them the same way.
for _folder in ("recipes", "eval"):
    if str(REPO_ROOT / _folder) not in sys.path:
        sys.path.append(str(REPO_ROOT / _folder))

TINY_SENTENCES = [
    "the cat sat on the mat",
    "a dog runs in the park",
    "the weather is nice today",
    "he drove his car to work",
    "she reads a book at night",
    "children play football outside",
    "the market opens at nine",
    "rain falls on the city",
    "a man is playing a guitar",
    "the train leaves the station",
    "birds fly over the lake",
    "we cook pasta for dinner",
]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from recipe_tools import build_tiny_bert

    path = tmp_path_factory.mktemp("tiny-bert")
    build_tiny_bert(path, sentences=TINY_SENTENCES)
    return path


# Training arguments of the short trainer runs: on the CPU, nothing reported, no progress bar.
QUIET_CPU = {"report_to": [], "use_cpu": True, "disable_tqdm": True}
# ... and reproducible: a constant learning rate, seed 0, no dataloader workers, a log line every step.
SHORT_RUN = {
    **QUIET_CPU,
    "learning_rate": 5e-2,
    "lr_scheduler_type": "constant",
    "logging_steps": 1,
    "seed": 0,
    "dataloader_num_workers": 0,
}


def pairs_dataset(sentences: list[str] = TINY_SENTENCES, shift: int = 1):
    """(anchor, positive) pairs: each sentence with the one ``shift`` places further."""
    from datasets import Dataset

    return Dataset.from_dict({"anchor": sentences, "positive": sentences[shift:] + sentences[:shift]})


def build_trainer(model, loss, output_dir, *, dataset=None, eval_dataset=None, callbacks=(), **arguments):
    """A SentenceTransformerTrainer of ``model`` and ``loss`` on ``dataset`` (default: :func:`pairs_dataset`), with
    the training ``arguments`` added to :data:`QUIET_CPU`."""
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    return SentenceTransformerTrainer(
        model=model,
        args=SentenceTransformerTrainingArguments(output_dir=str(output_dir), **{**QUIET_CPU, **arguments}),
        train_dataset=pairs_dataset() if dataset is None else dataset,
        eval_dataset=eval_dataset,
        loss=loss,
        callbacks=list(callbacks),
    )


def stop_at(step: int):
    """A trainer callback that ends training after ``step`` steps (an interrupted run)."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= step:
                control.should_training_stop = True

    return StopAt()


@pytest.fixture()
def tiny_model(tiny_model_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(tiny_model_dir), device="cpu")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


def copy_head_lines(source: Path, destination: Path, lines: int) -> None:
    """Copy the first ``lines`` lines of a (read-only) shared data file into a test's folder."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    head = source.read_text(encoding="utf-8").splitlines(keepends=True)[:lines]
    destination.write_text("".join(head), encoding="utf-8")


def load_script(relative_path: str, name: str):
    """Import a script of the repository (a recipe or a benchmark, not part of the package) as a module named
    ``name``, registered in ``sys.modules`` (dataclasses and pickling look their module up there)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(*target: str, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` on a free loopback port (gloo on CPU), followed by ``target``
    (a script path and its arguments, or ``-m module ...``)."""
    import sys

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *target,
    ]


@pytest.fixture(scope="session")
def fork_server(tmp_path_factory):
    """One process that has imported sentence-transformers and the package, forking the tests' worker processes
    (tests/forked.py): a torchrun rank or a trainer run to kill then costs no import of its own (starting the server
    costs one, 5-7 s, for the whole session)."""
    from tests.forked import ForkServer

    server = ForkServer(tmp_path_factory.mktemp("fork-server") / "server.log")
    yield server
    server.close()


@pytest.fixture()
def one_torch_thread():
    """Tiny tensors: one thread avoids OpenMP spinning on a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The test files that run native convolution kernels (oneDNN: the vision models) or compiled kernels
# (torch.compile / dynamo). .ci/run runs them ("kernels" marker) again under glibc's heap checks and another oneDNN
# ISA, since those kernels differ between CPUs (an AVX2 AMD EPYC corrupted the heap where AVX-512 machines did not).
KERNEL_TEST_FILES = {
    "test_onednn_workaround.py",
    "test_vision_training.py",
    "test_vision_recipe.py",
    "test_vision_evaluation.py",
    "test_vision_objectives.py",
    "test_simclr_ablation.py",
    "test_simclr_presets.py",
    "test_simclr_runner.py",
    "test_dynamo_explain.py",
    "test_weince_hotpath.py",
    "test_rb_sigmoid_hotpath.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in KERNEL_TEST_FILES:
            item.add_marker(pytest.mark.kernels)
