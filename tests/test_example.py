"""The README's example trains to a sensible accuracy and resumes from its checkpoint."""
import importlib.util
import os

import pytest

from tests.harness import REPO, run_ranks

FASHION = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"


def body_example(argv):
    spec = importlib.util.spec_from_file_location(
        "fashion_mnist", os.path.join(REPO, "examples", "fashion_mnist.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.mark.timeout(300)
def test_example_trains_and_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    if os.path.exists(FASHION):
        common, first, second, floor = ["--max-train", "8000"], 1, 2, 0.7
    else:  # scikit-learn digits fallback: smaller, so more epochs
        common, first, second, floor = ["--data-dir", str(tmp_path)], 2, 3, 0.8
    run_ranks(body_example, 2, "gloo", init=False,
              args=(common + ["--epochs", str(first), "--checkpoint", ckpt],))
    assert os.path.exists(ckpt)
    accuracies, output = run_ranks(body_example, 2, "gloo", init=False, with_output=True,
                                   args=(common + ["--epochs", str(second),
                                                   "--checkpoint", ckpt],))
    assert f"resumed from {ckpt} after epoch {first}" in output
    assert f"epoch {second}/{second}" in output and f"epoch {first}/{second}" not in output
    assert accuracies[0] == accuracies[1] and accuracies[0] > floor, accuracies
