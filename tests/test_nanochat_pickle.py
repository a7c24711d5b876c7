"""A nanochat checkpoint whose pickle needs a Python object is refused in one line naming it, without torch's
advice to re-run with weights_only=False."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from nanoinfer.cli import main

CALC_NANOCHAT = Path(__file__).resolve().parent.parent / "src" / "nanoinfer" / "assets" / "calc-nanochat"


def test_a_checkpoint_holding_a_python_object_is_refused_in_one_line(tmp_path, capsys):
    folder = shutil.copytree(CALC_NANOCHAT, tmp_path / "model")
    [checkpoint] = folder.glob("model_*.pt")
    state = torch.load(checkpoint, weights_only=True)
    state["training_args"] = argparse.Namespace(lr=0.02)       # what a training script might save beside tensors
    torch.save(state, checkpoint)

    assert main(["generate", "--model", str(folder), "hi"]) == 2
    err = capsys.readouterr().err
    [error] = [line for line in err.splitlines() if line.startswith("nanoinfer: error:")]
    assert error == (f"nanoinfer: error: {checkpoint} could not be read as a weights-only torch checkpoint: it "
                     "holds a pickled argparse.Namespace, not only tensors, and nanoinfer never unpickles code "
                     "(save the state dict's tensors alone)")
    assert len(err.strip().splitlines()) == 2, err          # the loading notice, then the error: nothing else
    assert "weights_only=False" not in err and "Traceback" not in err
