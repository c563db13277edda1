"""Silero's network in numpy (``ivr.audio.silero_net``) against onnxruntime running the same
file: the same probabilities and states on real speech and line noise, window after window with
the state carried, at both rates and in batches; a file of another layout falls back to
onnxruntime with a warning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import soxr
from audio_fixtures import noise_pcm16, speech_pcm16, trimmed
from onnx import TensorProto, helper
from structlog.testing import capture_logs
from threadpoolctl import threadpool_info

from ivr.audio.silero_net import SileroLayoutError, read_weights
from ivr.audio.vad import SileroModel

SENTENCES = (
    "I would like to check my account balance, please.",
    "Do you have parking nearby?",
    "My card was declined at the store this morning.",
)


def streams_at(rate: int) -> np.ndarray:
    """Three callers at different levels over different noise, as float32 (3, samples)."""
    out = []
    for i, text in enumerate(SENTENCES):
        pcm = (
            noise_pcm16(0.3, dbfs=-55, seed=i)
            + trimmed(speech_pcm16(text))
            + noise_pcm16(0.6, dbfs=-45 + 5 * i, seed=10 + i, color="white")
        )
        x = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768 * (0.3 + 0.5 * i)
        out.append(x if rate == 8000 else soxr.resample(x, 8000, rate).astype(np.float32))
    n = min(len(x) for x in out)
    return np.stack([x[:n] for x in out])


@pytest.mark.parametrize("rate", [8000, 16000])
def test_numpy_gives_onnxruntimes_probabilities_and_states(rate: int) -> None:
    ours = SileroModel(rate)
    theirs = SileroModel(rate, runtime="onnxruntime")
    assert (ours.runtime, theirs.runtime) == ("numpy", "onnxruntime")
    audio = streams_at(rate)
    win, ctx = ours.window, ours.context
    states = {m.runtime: np.zeros((2, 3, 128), np.float32) for m in (ours, theirs)}
    context = np.zeros((3, ctx), np.float32)
    worst = worst_state = 0.0
    speech_windows = 0
    for start in range(0, audio.shape[1] - win + 1, win):
        window = audio[:, start : start + win]
        batch = np.concatenate((context, window), axis=1)
        context = window[:, -ctx:]
        before = states["numpy"]
        p_np, states["numpy"] = ours.predict_batch(batch, before)
        p_ort, states["onnxruntime"] = theirs.predict_batch(batch, states["onnxruntime"])
        assert p_np.shape == p_ort.shape == (3, 1) and p_np.dtype == np.float32
        worst = max(worst, float(np.abs(p_np - p_ort).max()))
        worst_state = max(worst_state, float(np.abs(states["numpy"] - states["onnxruntime"]).max()))
        speech_windows += int((p_ort > 0.5).sum())
        # A stream alone gives what it gives in the batch (the batch's rows do not mix).
        alone, _ = ours.predict(batch[1:2], np.ascontiguousarray(before[:, 1:2]))
        assert abs(alone - float(p_np[1, 0])) < 1e-5
    assert speech_windows > 30  # the speech was heard: the comparison covers speech and noise
    assert worst < 1e-4, worst
    assert worst_state < 1e-3, worst_state


def test_a_window_of_the_wrong_length_is_refused_by_its_size() -> None:
    model = SileroModel(8000)
    with pytest.raises(ValueError, match="288 samples"):
        model.predict_batch(np.zeros((1, 256), np.float32), np.zeros((2, 1, 128), np.float32))


def test_blas_runs_on_one_thread_once_the_model_is_loaded() -> None:
    SileroModel(8000)
    blas = [pool for pool in threadpool_info() if pool["user_api"] == "blas"]
    assert blas and all(pool["num_threads"] == 1 for pool in blas), blas


def not_silero(path: Path) -> Path:
    """A valid ONNX graph with Silero's inputs and outputs but none of its weights."""
    inputs = [
        helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", 288]),
        helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "B", 128]),
        helper.make_tensor_value_info("sr", TensorProto.INT64, []),
    ]
    outputs = [
        helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", 1]),
        helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, "B", 128]),
    ]
    nodes = [
        helper.make_node("ReduceMean", ["input"], ["output"], axes=[1], keepdims=1),
        helper.make_node("Identity", ["state"], ["stateN"]),
    ]
    graph = helper.make_graph(nodes, "not_silero", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_another_layout_is_named_and_run_by_onnxruntime(tmp_path: Path) -> None:
    path = not_silero(tmp_path / "other.onnx")
    with pytest.raises(SileroLayoutError, match=r"other\.onnx"):
        read_weights(path, 8000)
    with capture_logs() as logs:
        model = SileroModel(8000, model_file=path)
    assert model.runtime == "onnxruntime"
    warnings = [e for e in logs if e["event"] == "vad.silero_on_onnxruntime"]
    assert len(warnings) == 1 and "other.onnx" in warnings[0]["reason"], logs
    probs, _ = model.predict_batch(
        np.full((2, 288), 0.25, np.float32), np.zeros((2, 2, 128), np.float32)
    )
    assert probs.shape == (2, 1) and np.allclose(probs, 0.25)
