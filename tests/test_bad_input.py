"""Every malformed input gets one line naming the field and exit 2, before anything is built.

The table goes through ``show-spec``, which runs the same up-front checks as ``run``
(``testbed.setup.check_spec``); the cases that need a placement go through ``run``.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from testbed.cli import app

TOPO_OK = """\
name: t2
servers:
  - {name: a, gpu: rtx3090, cpu_mem_gb: 64}
  - {name: b, gpu: a40, cpu_mem_gb: 64}
links:
  - {src: a, dst: b, bandwidth_gbps: 1, delay_ms: 5, symmetric: true}
"""

# (spec YAML, what the one line must name)
SPECS = [
    ("workload: {rate_per_s: -1}\n", "workload.rate_per_s"),
    ("workload: {rate_per_s: 1.0e+9}\n", "workload.rate_per_s"),
    ("workload: {duration_s: 1.0e+12}\n", "workload.duration_s"),
    ("workload: {duration_s: 0}\n", "workload.duration_s"),
    ("workload: {rate_per_s: 50000, duration_s: 3600}\n", "requests"),
    ("workload: {warmup_s: 20}\n", "warmup_s"),
    ("workload: {warmup_s: -1}\n", "workload.warmup_s"),
    ("workload: {prompt_tokens: 0}\n", "workload.prompt_tokens"),
    ("workload: {gen_tokens: -1}\n", "workload.gen_tokens"),
    ("workload: {users: 0}\n", "workload.users"),
    ("workload: {zipf_s: -2}\n", "workload.zipf_s"),
    ("workload: {model: gpt-5}\n", "workload.model"),
    ("workload: {top_k: 99}\n", "workload.top_k"),
    ("workload: {top_k: 0}\n", "workload.top_k"),
    ("workload: {calibration_tokens: 0}\n", "workload.calibration_tokens"),
    ("workload: {trace: missing.jsonl}\n", "workload.trace"),
    ("workload: {trace_params: {nonsense: 1}}\n", "trace_params"),
    ("workload: {nope: 1}\n", "workload.nope"),
    ("workload: {arrivals: burst}\n", "workload.arrivals"),
    ("workload: {arrivals: gamma, arrival_cv: 0}\n", "workload.arrival_cv"),
    ("workload: {arrival_cv: 3}\n", "arrival_cv"),
    ("workload: {arrivals: trace}\n", "requests_file"),
    ("workload: {arrivals: trace, requests_file: missing.csv}\n", "workload.requests_file"),
    ("workload: {lengths: trace, requests_file: x.csv, max_gen_tokens: -1}\n",
     "workload.max_gen_tokens"),
    ("quality: {budget: -0.1}\n", "quality.budget"),
    ("quality: {budget: 5}\n", "quality.budget"),
    ("quality: {profile: missing.npz}\n", "quality.profile"),
    ("quality: {replay: sometimes}\n", "quality.replay"),
    ("memory: {gpu_share: 2}\n", "memory.gpu_share"),
    ("memory: {cpu_share: 0}\n", "memory.cpu_share"),
    ("seed: -1\n", "seed"),
    ("seed: abc\n", "seed"),
    ("backend: gpu\n", "backend"),
    ("physics: quantum\n", "physics"),
    ("window_s: 1.0e-9\n", "window_s"),
    ("window_s: 0\n", "window_s"),
    ("sla_s: 0\n", "sla_s"),
    ("router: {name: nope}\n", "router.name"),
    ("router: {name: hetroute, params: {beam_width: 0}}\n", "beam_width"),
    ("router: {name: hetroute, params: {no_such_knob: 1}}\n", "no_such_knob"),
    ("router: {name: 'no.such.module:Router'}\n", "router.name"),
    ("topology: nowhere.yaml\n", "no such topology"),
    ("topology: {servers: 0}\n", "topology.servers"),
    ("engine: {max_batch_tokens: 0}\n", "engine.max_batch_tokens"),
    ("engine: {decision_s: 5}\n", "engine.decision_s"),
    ("engine: {decision_s: sometimes}\n", "engine.decision_s"),
    ("engine: {hold_s: -1}\n", "engine.hold_s"),
    ("engine: {load_overlap: async}\n", "engine.load_overlap"),
    ("physics: paper\nengine: {load_overlap: copy_engine}\n", "engine.load_overlap"),
    ("engine: {prefetch_link: pcie}\n", "engine.prefetch_link"),
    ("engine: {prefetch_link: own, load_overlap: copy_engine}\n", "engine.prefetch_link"),
    ("sim: {payload_efficiency: 0}\n", "sim.payload_efficiency"),
    ("emu: {dilation: -4}\n", "emu.dilation"),
    ("emu: {dilation: 0}\n", "emu.dilation"),
    ("emu: {cpu_fraction: 7}\n", "emu.cpu_fraction"),
    ("emu: {cpu_fraction: 0}\n", "emu.cpu_fraction"),
    ("emu: {max_drain_s: 0}\n", "emu.max_drain_s"),
    ("emu: {expert_d_model: 4}\n", "emu.expert_d_model"),
    ("emu: {delay_mechanism: pigeons}\n", "emu.delay_mechanism"),
    ("faults: [{kind: explode, at_s: 1}]\n", "faults[0].kind"),
    ("faults: [{kind: kill_worker, at_s: -1, server: s0}]\n", "faults[0].at_s"),
    ("faults: [{kind: kill_worker, at_s: 1, server: nowhere}]\n", "faults[0].server"),
    ("faults: [{kind: cut_link, at_s: 1, server: s0}]\n", "faults[0]"),
    ("faults: [{kind: kill_worker, at_s: 100, server: s0}]\n", "faults[0].at_s"),
    ("unknown_field: 1\n", "unknown_field"),
    ("seed: 1\nseed: 2\n", "duplicate key 'seed'"),
    ("workload: {rate_per_s: 10, rate_per_s: 20}\n", "duplicate key 'rate_per_s'"),
    ("workload: {rate_per_s: [}\n", "not valid YAML"),
    ("- just\n- a list\n", "valid dictionary"),
]


def _check(result, needle: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [ln for ln in result.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert "Traceback" not in result.output


@pytest.fixture
def cli():
    return CliRunner()


@pytest.mark.parametrize("content, needle", SPECS)
def test_bad_spec_is_one_line_and_exit_2(cli, tmp_path, content, needle):
    assert len(SPECS) >= 40
    spec = tmp_path / "bad.yaml"
    spec.write_text(content)
    _check(cli.invoke(app, ["show-spec", str(spec)]), needle)


@pytest.mark.parametrize("raw, needle", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "not a text file"),
    ("workload: {model: caf\xe9}".encode("latin-1"), "not a text file"),
])
def test_binary_or_non_utf8_file_is_one_line(cli, tmp_path, raw, needle):
    spec = tmp_path / "bin.yaml"
    spec.write_bytes(raw)
    _check(cli.invoke(app, ["show-spec", str(spec)]), needle)


@pytest.mark.parametrize("topo, needle", [
    (TOPO_OK.replace("gpu: rtx3090", "gpu: gtx9999"), "gpu"),
    (TOPO_OK.replace("cpu_mem_gb: 64}\n  - {name: b", "cpu_mem_gb: -1}\n  - {name: b"), "cpu_mem_gb"),
    (TOPO_OK.replace("gpu: rtx3090", "gpu_tflops: 1.0e-9, pcie_gb_s: 16, gpu_mem_gb: 24"), "gpu_tflops"),
    (TOPO_OK.replace("symmetric: true", "symmetric: false"), "no link b->a"),
    (TOPO_OK.replace("delay_ms: 5", "delay_ms: -5"), "delay_ms"),
    (TOPO_OK.replace("name: b,", "name: a,"), "unique"),
    (TOPO_OK + "servers: []\n", "duplicate key 'servers'"),
])
def test_bad_topology_is_one_line(cli, tmp_path, topo, needle):
    (tmp_path / "t.yaml").write_text(topo)
    (tmp_path / "s.yaml").write_text(f"topology: {tmp_path / 't.yaml'}\n")
    _check(cli.invoke(app, ["show-spec", str(tmp_path / "s.yaml")]), needle)


def test_model_that_cannot_fit_is_refused_up_front(cli, tmp_path):
    topo = TOPO_OK.replace("gpu: rtx3090, cpu_mem_gb: 64", "gpu: t4, cpu_mem_gb: 1") \
                  .replace("gpu: a40, cpu_mem_gb: 64", "gpu: t4, cpu_mem_gb: 1")
    (tmp_path / "t.yaml").write_text(topo)
    (tmp_path / "s.yaml").write_text(f"topology: {tmp_path / 't.yaml'}\nworkload: {{model: mixtral}}\n"
                                       "memory: {gpu_share: 0.3}\n")
    _check(cli.invoke(app, ["show-spec", str(tmp_path / "s.yaml")]), "does not fit")


@pytest.mark.parametrize("override, needle", [
    ("workload.rate_per_s=abc", "workload.rate_per_s"),
    ("nosuch.key=1", "nosuch"),
    ("novalue", "key=value"),
    ("emu.dilation=-1", "emu.dilation"),
])
def test_bad_override_is_one_line(cli, override, needle):
    _check(cli.invoke(app, ["show-spec", "--set", override]), needle)


def test_far_outside_real_hardware_warns(cli, tmp_path):
    topo = TOPO_OK.replace("gpu: rtx3090", "gpu_tflops: 0.001, pcie_gb_s: 16, gpu_mem_gb: 24")
    (tmp_path / "t.yaml").write_text(topo)
    (tmp_path / "s.yaml").write_text(f"topology: {tmp_path / 't.yaml'}\nworkload: {{model: switch}}\n")
    r = cli.invoke(app, ["show-spec", str(tmp_path / "s.yaml")])
    assert r.exit_code == 0, r.output
    assert "warning: servers[0].gpu_tflops: 0.001 is far outside real GPUs" in r.stderr


ROUTERS = '''
from hetroute.routers.greedy import Greedy

class Boom(Greedy):
    def place(self):
        raise RuntimeError("no room for expert 7")
'''


@pytest.mark.parametrize("module, cls, needle", [
    (ROUTERS, "Boom", "failed in place(): RuntimeError: no room for expert 7 at boomrouter.py:"),
    ("raise ImportError('numpy too old')\n", "Boom", "cannot load router"),
    ("1 / 0\n", "Boom", "ZeroDivisionError"),
])
def test_router_errors_are_one_line_and_the_run_is_marked_failed(cli, tmp_path, monkeypatch,
                                                                 module, cls, needle):
    (tmp_path / "boomrouter.py").write_text(textwrap.dedent(module))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "boomrouter", raising=False)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"topology: small3\nrouter: {{name: 'boomrouter:{cls}'}}\n"
                    "workload: {model: switch, duration_s: 0.3, warmup_s: 0.1, calibration_tokens: 64}\n")
    r = cli.invoke(app, ["run", str(spec), "--quiet", "--out", str(tmp_path / "out")])
    _check(r, needle)
    if "place()" in needle:  # the run had started: its folder says it failed, and why
        info = json.loads((tmp_path / "out" / "run.json").read_text())
        assert info["status"] == "failed" and "no room for expert 7" in info["error"]
        tb = (tmp_path / "out" / info["traceback"]).read_text()  # the whole story, for sweeps
        assert "Traceback" in tb and "boomrouter.py" in tb and "no room for expert 7" in tb
    else:  # refused before anything was built
        assert not (tmp_path / "out").exists()
