"""The call shape of one training step of a loss: how deep its own (st_weince) frames go and how many of its own
functions run (issue 52 item 3).

For WEINCELoss, CachedWEINCELoss and (for information) RBSigmoidLoss, on a tiny BERT built from a config (no
download), one training ``forward`` and its ``backward`` run under ``sys.setprofile`` after a warm-up step (the
first training step makes once-only checks). Recorded per loss:

- ``frames_to_blended_cross_entropy``: the own frames on the stack when the fused cross-entropy's entry
  ``blended_cross_entropy`` is entered, counted from ``forward`` (both included; None where it is not called);
- ``max_own_depth``: the most own frames on the stack at once;
- ``own_functions``: the distinct own functions that run (statistics logged; ``own_functions_unlogged_step``: on a
  step that logs none, as a trainer's steps between its logging steps);
- ``file_crossings``: the distinct (caller, callee) pairs of own functions in different files, and
  ``file_crossing_calls`` every such call;
- ``functional_to_losses_calls``: calls from ``st_weince/functional/`` into ``st_weince/losses/`` (a closure handed
  down).

    python benchmarks/call_shape.py --label after    # adds "after" to runs/benchmarks/call_shape/call_shape.json
    PYTHONPATH=/tmp/old python benchmarks/call_shape.py --label before --output benchmarks/results/call_shape.json

The committed ``benchmarks/results/call_shape.json`` changes only when ``--output`` names it. The default is computed
here, not from ``benchmarks.lab.outputs``: ``PYTHONPATH`` may name an older checkout that lacks it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_COMPREHENSION = re.compile(r"<(listcomp|dictcomp|setcomp|genexpr)>")
SENTENCES = [
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


def _tiny_model(folder: Path):
    sys.path.insert(0, str(REPO_ROOT / "recipes"))
    from sentence_transformers import SentenceTransformer

    from recipe_tools import build_tiny_bert

    build_tiny_bert(folder, sentences=SENTENCES)
    return SentenceTransformer(str(folder), device="cpu")


class CallShape:
    """A ``sys.setprofile`` hook that records the own frames of the calls it sees."""

    def __init__(self, package_dir: Path) -> None:
        self.package = str(package_dir) + "/"
        self.functions: set[tuple[str, int, str]] = set()
        self.crossings: set[tuple[tuple[str, str], tuple[str, str]]] = set()
        self.crossing_calls = 0
        self.functional_to_losses = 0
        self.max_depth = 0
        self.deepest: list[str] = []
        self.depth_at: dict[str, int] = {}

    def _own(self, code) -> bool:
        """An own function's frame; not a comprehension's (Python 3.12 inlines them), a lambda's yes."""
        return code.co_filename.startswith(self.package) and not _COMPREHENSION.fullmatch(code.co_name)

    def _name(self, code) -> tuple[str, str]:
        return code.co_filename[len(self.package) :], code.co_qualname

    def __call__(self, frame, event: str, arg) -> None:
        if event != "call" or not self._own(frame.f_code):
            return
        code = frame.f_code
        self.functions.add((code.co_filename, code.co_firstlineno, code.co_qualname))
        caller = frame.f_back
        while caller is not None and not self._own(caller.f_code):  # through library frames to the own caller
            caller = caller.f_back
        if caller is not None:
            callee_file, caller_file = self._name(code)[0], self._name(caller.f_code)[0]
            if callee_file != caller_file:
                self.crossings.add((self._name(caller.f_code), self._name(code)))
                self.crossing_calls += 1
            if caller_file.startswith("functional/") and callee_file.startswith("losses/"):
                self.functional_to_losses += 1
        depth, names, walk = 0, [], frame
        while walk is not None:
            if self._own(walk.f_code):
                depth += 1
                names.append(walk.f_code.co_qualname)
            walk = walk.f_back
        if depth > self.max_depth:
            self.max_depth, self.deepest = depth, names[::-1]
        if code.co_name == "blended_cross_entropy" and "blended_cross_entropy" not in self.depth_at:
            # counted from the outermost forward (a cached loss's forward runs the mixin's, which calls back)
            forwards = [i for i, name in enumerate(names) if name.endswith(".forward")]
            self.depth_at["blended_cross_entropy"] = forwards[-1] + 1 if forwards else depth

    def record(self) -> dict:
        return {
            "frames_to_blended_cross_entropy": self.depth_at.get("blended_cross_entropy"),
            "max_own_depth": self.max_depth,
            "deepest_stack": self.deepest,
            "own_functions": len(self.functions),
            "file_crossings": len(self.crossings),
            "file_crossing_calls": self.crossing_calls,
            "functional_to_losses_calls": self.functional_to_losses,
            "functions": sorted(f"{Path(f).relative_to(self.package)}:{name}" for f, _, name in self.functions),
        }


def measure(model=None) -> dict[str, dict]:
    """The call shape of one training step of each loss (see the module docstring)."""
    import torch

    import st_weince
    from st_weince.losses import CachedWEINCELoss, RBSigmoidLoss, WEINCELoss

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        model = _tiny_model(Path(folder)) if model is None else model
    tokenize = getattr(model, "preprocess", model.tokenize)
    features = [tokenize(SENTENCES), tokenize(SENTENCES[1:] + SENTENCES[:1])]
    losses = {
        "WEINCELoss": lambda: WEINCELoss(model),
        "CachedWEINCELoss": lambda: CachedWEINCELoss(model, mini_batch_size=4),
        "RBSigmoidLoss": lambda: RBSigmoidLoss(model),
    }
    results = {}
    for name, make in losses.items():
        loss = make()
        loss.mark_state_managed("benchmarks/call_shape.py")  # no trainer: nothing else handles RB-Sigmoid's t
        loss.train()
        model.zero_grad()
        loss(features).backward()  # the warm-up step: the first training step's once-only checks
        results[name] = _profiled(loss, features, Path(st_weince.__file__).parent).record()
        loss.log_statistics = False  # a trainer's step that does not log (prepare_trainer asks only at logging steps)
        unlogged = _profiled(loss, features, Path(st_weince.__file__).parent)
        results[name]["own_functions_unlogged_step"] = len(unlogged.functions)
    return results


def _profiled(loss, features, package_dir: Path) -> CallShape:
    """The call shape of one training forward and backward of ``loss``."""
    shape = CallShape(package_dir)
    sys.setprofile(shape)
    threading.setprofile(shape)
    try:
        loss(features).backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="current", help="the key of this run in the output (e.g. before, after)")
    parser.add_argument(
        "--output", type=Path, default=REPO_ROOT / "runs" / "benchmarks" / "call_shape" / "call_shape.json"
    )
    args = parser.parse_args()

    from st_weince.utils.provenance import provenance

    results = measure()
    record = json.loads(args.output.read_text()) if args.output.exists() else {}
    record[args.label] = {"provenance": provenance(), "losses": results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1) + "\n")
    for name, shape in results.items():
        summary = {key: value for key, value in shape.items() if key != "functions"}
        print(f"{args.label} {name}: {summary}")


if __name__ == "__main__":
    main()
