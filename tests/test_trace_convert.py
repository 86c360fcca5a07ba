"""Routing logs in (issue 13): Hugging Face router logits and vLLM-style per-layer JSON
lines become the project's trace; missing and tied cells are reported, not guessed."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from workloads import get_model
from workloads.traces.convert import convert
from workloads.traces import JsonlTrace

SWITCH = get_model("switch")  # 12 layers, 8 experts per layer, top-1
MIXTRAL = get_model("mixtral")  # 32 layers, 8 experts, top-2


def _logits(rng, L, T, E):
    return rng.normal(size=(L, T, E))


def test_hf_npz_missing_cell_drops_its_token_and_a_tie_goes_to_the_lower_id(tmp_path):
    rng = np.random.default_rng(0)
    x = _logits(rng, MIXTRAL.n_layers, 5, 8)
    x[7, 2, :] = np.nan  # token 2 lost its layer-7 logits
    x[3, 0, :] = 0.0
    x[3, 0, [5, 6]] = 4.0  # token 0, layer 3: experts 5 and 6 lead
    x[3, 0, [1, 2]] = 3.0  # ... and 1 and 2 tie for nothing (below the top-2): no tie
    x[4, 1, :] = 0.0
    x[4, 1, 6] = 5.0
    x[4, 1, [2, 3]] = 2.0  # token 1, layer 4: 2 and 3 tie for the second slot -> 2
    np.savez(tmp_path / "log.npz", router_logits=x)
    report = convert(tmp_path / "log.npz", tmp_path / "out.jsonl", MIXTRAL, "hf")
    assert report.tokens_written == 4 and report.tokens_dropped_missing == 1
    assert report.ties_broken == 1
    assert "missing" in report.format() and "token 2 layer 7" in report.format()
    trace = JsonlTrace(tmp_path / "out.jsonl", MIXTRAL)
    r = trace.route(0, 4)
    assert r.experts.shape == (4, 32, 2)
    assert sorted(r.experts[0, 3]) == [5, 6] and list(r.experts[1, 4]) == [6, 2]
    np.testing.assert_allclose(r.weights.sum(-1), 1.0)
    # token 3 of the log is token 2 of the trace (token 2 was dropped)
    assert sorted(r.experts[2, 0]) == sorted(np.argsort(-x[0, 3])[:2])


def test_hf_jsonl_several_requests(tmp_path):
    rng = np.random.default_rng(1)
    lines = [json.dumps({"request": r, "router_logits": _logits(rng, 12, 3, 8).tolist()})
             for r in (0, 1)]
    (tmp_path / "log.jsonl").write_text("\n".join(lines + ["not json"]) + "\n")
    report = convert(tmp_path / "log.jsonl", tmp_path / "out.jsonl", SWITCH, "hf")
    assert report.requests == 2 and report.tokens_written == 6 and report.skipped == 1
    assert JsonlTrace(tmp_path / "out.jsonl", SWITCH).request_ids == (0, 1)


def _vllm(req, layer, ids, weights=None, positions=None):
    rec = {"request_id": req, "layer": layer, "topk_ids": ids}
    if weights is not None:
        rec["topk_weights"] = weights
    if positions is not None:
        rec["positions"] = positions
    return json.dumps(rec)


def test_vllm_lines_with_a_missing_and_a_conflicting_cell(tmp_path):
    L = SWITCH.n_layers
    lines = []
    for layer in range(L):  # request "a": a prefill step of 3 tokens, then a decode step
        lines.append(_vllm("a", layer, [[layer % 8], [(layer + 1) % 8], [(layer + 2) % 8]],
                           [[1.0], [1.0], [1.0]]))
    for layer in range(L):
        if layer != 5:  # the decode token never logged layer 5: missing
            lines.append(_vllm("a", layer, [[3]], [[0.9]], positions=[3]))
    for layer in range(L):  # request "b": one token, logged flat, no weights
        lines.append(json.dumps({"request": "b", "layer_id": layer, "expert_ids": [7]}))
    lines.append(_vllm("b", 2, [[1]], positions=[0]))  # logged again, other expert: conflict
    lines.append(_vllm("b", 99, [[1]]))  # layer out of range: skipped
    (tmp_path / "log.jsonl").write_text("\n".join(lines) + "\n")
    report = convert(tmp_path / "log.jsonl", tmp_path / "out.jsonl", SWITCH, "vllm")
    assert report.requests == 2 and report.tokens_written == 4
    assert report.tokens_dropped_missing == 1 and report.duplicates_conflicting == 1
    assert report.skipped == 1 and report.weights_missing == L + 1
    text = report.format()
    assert "lacks layer(s) [5]" in text and "first kept" in text
    trace = JsonlTrace(tmp_path / "out.jsonl", SWITCH)
    assert trace.route(0, 3).experts[:, 0, 0].tolist() == [0, 1, 2]
    assert (trace.route(1, 1).experts[0, :, 0] == 7).all()  # the first logging of layer 2 kept


def test_convert_command_prints_the_report_and_rejects_nonsense(tmp_path):
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "log.npz", router_logits=_logits(rng, 12, 4, 8))
    run = lambda *a: subprocess.run([sys.executable, "-m", "workloads.traces", *a],
                                    capture_output=True, text=True, timeout=120)
    ok = run("convert", "--format", "hf", "--model", "switch", str(tmp_path / "log.npz"),
             str(tmp_path / "out.jsonl"))
    assert ok.returncode == 0, ok.stderr
    assert "wrote 1 requests, 4 tokens" in ok.stdout
    np.savez(tmp_path / "bad.npz", router_logits=_logits(rng, 3, 4, 8))  # 3 layers, not 12
    bad = run("convert", "--format", "hf", "--model", "switch", str(tmp_path / "bad.npz"),
              str(tmp_path / "o2.jsonl"))
    assert bad.returncode == 2 and "no complete token" in bad.stderr


def test_unknown_format_is_refused(tmp_path):
    (tmp_path / "x.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="format"):
        convert(tmp_path / "x.jsonl", tmp_path / "o.jsonl", SWITCH, "csv")
