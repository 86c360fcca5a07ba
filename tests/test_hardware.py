"""The hardware model and the step rule the world runs (issue 12)."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from hetroute.hardware import (CATALOGUE, Device, FfnShape, HardwareError, ffn_seconds, gpu_class,
                               nearest_class)
from hetroute.service import HardwareService, PaperService
from hetroute.system import Precision
from testbed.cli import app
from testbed.steps import DENSE, Job, StepScheduler
from topologies import TopologyError, load_topology, parse_topology
from workloads import get_model

MIXTRAL = get_model("mixtral").shape()
A40 = Device.from_class(gpu_class("a40"))


def test_catalogue_numbers_are_datasheet_shaped_and_cited():
    for g in CATALOGUE.values():
        assert g.fp16_tflops > 0 and g.mem_bw_gb_s > 0 and g.pcie_gb_s > 0 and g.mem_gb > 0
        assert "datasheet" in g.source or "whitepaper" in g.source
    assert gpu_class("A40").mem_bw_gb_s == 696 and gpu_class("h100-sxm").fp16_tflops == 989.4
    assert gpu_class("v100").precisions == ("fp16",)  # no weight-only INT kernels before sm 7.5
    assert nearest_class(70, 24).name == "rtx3090"


def test_small_batches_are_memory_bound_and_flat_in_tokens():
    ffn = MIXTRAL.expert_ffn
    t1, t64, t4096 = (ffn_seconds(A40, ffn, b) for b in (1, 64, 4096))
    weights = ffn.weight_bytes("fp16")
    assert t1 == pytest.approx(3 * A40.launch_s + (weights + ffn.act_bytes(1)) / A40.mem_bw)
    assert t64 < 1.1 * t1  # nearly flat: the weights dominate
    assert t4096 == pytest.approx(3 * A40.launch_s + ffn.flops(4096) / A40.flops)  # compute-bound


def test_int4_reads_a_quarter_of_fp16_bytes_and_pays_dequantisation():
    ffn = MIXTRAL.expert_ffn
    fp16, int4 = ffn.weight_bytes("fp16"), ffn.weight_bytes("int4")
    assert int4 == pytest.approx(fp16 / 4, rel=0.04)  # plus one FP16 scale per 128 weights
    assert int4 == MIXTRAL.expert_bytes[Precision.INT4]
    t16, t4 = ffn_seconds(A40, ffn, 1, "fp16"), ffn_seconds(A40, ffn, 1, "int4")
    assert 3.0 < t16 / t4 < 4.0
    # compute-bound, the dequantisation is extra work on the CUDA cores
    assert ffn_seconds(A40, ffn, 4096, "int4") > ffn_seconds(A40, ffn, 4096, "fp16")


def _sched(svc, resident=lambda r: True, precisions=None, moe_kernels="fused"):
    prec = precisions or (lambda r: Precision.FP16)
    return StepScheduler(svc, 0, prec, resident, scope="layer", moe_kernels=moe_kernels)


def _hw_service(topology="small3"):
    cl = load_topology(topology).to_cluster()
    return HardwareService(cl, MIXTRAL), cl


@pytest.mark.parametrize("kind", ["per_expert", "fused"])
def test_a_step_costs_the_sum_of_its_replicas_batched_kernels_plus_the_dense_part(kind):
    svc, _ = _hw_service()
    sc = _sched(svc, moe_kernels=kind)
    for tok in range(5):  # five tokens: replica 0 gets all, replica 1 two of them
        sc.submit(Job(3, 0, tok, tok, 0, 0.0))
        if tok < 2:
            sc.submit(Job(3, 1, tok, tok, 0, 0.0))
    sc.submit(Job(3, DENSE, 9, 9, 4, 0.0))  # a sixth token's dense part, same layer
    step = sc.take(0.0)
    fp16 = Precision.FP16
    expected = svc.expert_s(0, fp16, 5) + svc.expert_s(0, fp16, 2) + svc.dense_s(0, 1, 5, 5)
    if kind == "fused":  # the two FP16 replicas share one set of launches
        expected -= svc.expert_launch_s(0)
    assert step.duration == pytest.approx(expected, rel=1e-12)
    assert step.replicas == 2 and step.tokens == 6 and len(step.jobs) == 8
    assert not sc.queue and sc.backlog(0.0) == pytest.approx(expected)  # the running step


def test_a_replica_reads_its_weights_once_per_step_whatever_its_token_count():
    svc, _ = _hw_service()
    one, many = _sched(svc), _sched(svc)
    one.submit(Job(0, 0, 0, 0, 0, 0.0))
    for tok in range(32):
        many.submit(Job(0, 0, tok, tok, 0, 0.0))
    t1, t32 = one.take(0.0).duration, many.take(0.0).duration
    assert t32 < 1.05 * t1  # 32 tokens cost about one weight read
    # while 32 separate steps would read the weights 32 times
    assert 32 * t1 > 25 * t32


def test_the_dense_part_occupies_the_stream_and_decode_reads_the_kv_cache():
    svc, _ = _hw_service()
    sc = _sched(svc)
    sc.submit(Job(0, DENSE, 0, 0, 0, 0.0))
    assert sc.backlog(0.0) > 0
    step = sc.take(0.0)
    assert sc.busy and step.duration == pytest.approx(svc.dense_s(0, 1, 1, 1))
    assert sc.backlog(0.0) == pytest.approx(step.duration)
    # a decode token at position 4000 reads 4000 positions of KV cache
    assert svc.dense_s(0, 1, 4000, 4000) > svc.dense_s(0, 1, 1, 1) + 4000 * MIXTRAL.kv_bytes_per_token \
        / svc.devices[0].mem_bw * 0.99


def test_a_cpu_resident_replica_pays_one_load_per_step_and_is_marked():
    svc, cl = _hw_service()
    sc = _sched(svc, resident=lambda r: r != 1)
    for tok in range(3):
        sc.submit(Job(0, 1, tok, tok, 0, 0.0))
    step = sc.take(0.0)
    fp16 = Precision.FP16
    load = MIXTRAL.expert_bytes[fp16] / (cl.pcie[0] * 0.8)
    assert step.duration == pytest.approx(load + svc.expert_s(0, fp16, 3))
    assert step.loads == 1 and not any(j.gpu for j in step.jobs)


def test_layers_are_served_oldest_request_first_and_batches_are_capped():
    svc, _ = _hw_service()
    sc = StepScheduler(svc, 0, lambda r: Precision.FP16, lambda r: True, scope="layer",
                       max_batch_tokens=2)
    sc.submit(Job(5, 0, "new", 1, 0, 0.0, prio=1.0))
    for tok in ("a", "b", "c"):
        sc.submit(Job(2, 0, tok, 0, 0, 0.0, prio=0.0))  # an older request, another layer
    step = sc.take(0.0)
    assert step.layer == 2 and step.tokens == 2  # the older request's layer, capped at 2
    sc.finish()
    assert sc.take(0.0).layer == 2  # its third token before the newer request
    sc.finish()
    assert sc.take(0.0).layer == 5


def test_paper_physics_is_the_additive_world_of_eq_9():
    cl = load_topology("small3").to_cluster()
    svc = PaperService(cl, MIXTRAL)
    assert svc.expert_s(1, Precision.INT4, 3) == pytest.approx(3 * MIXTRAL.expert_flops / cl.flops[1])
    assert svc.load_s(1, Precision.FP16) == pytest.approx(MIXTRAL.expert_bytes[Precision.FP16] / cl.pcie[1])


# -- input ---------------------------------------------------------------------------------
BASE = {"name": "t", "servers": [{"name": "a", "gpu": "a40", "cpu_mem_gb": 64},
                                 {"name": "b", "gpu_tflops": 50, "pcie_gb_s": 16, "gpu_mem_gb": 24,
                                  "cpu_mem_gb": 64}],
        "links": [{"src": "a", "dst": "b", "bandwidth_gbps": 1, "delay_ms": 1, "symmetric": True}]}


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["servers"][0].update(gpu="b200"), "servers[0]: gpu: unknown GPU class 'b200'"),
    (lambda d: d["servers"][0].update(mem_bw_gb_s=0), "servers[0].mem_bw_gb_s"),
    (lambda d: d["servers"][1].pop("gpu_tflops"), "servers[1]: gpu_tflops: required when no gpu"),
    (lambda d: d["servers"][0].update(pcie_gb_s=-1), "servers[0].pcie_gb_s"),
])
def test_bad_hardware_input_gets_one_line_naming_the_field(mutate, expected):
    d = yaml.safe_load(yaml.safe_dump(BASE))
    mutate(d)
    with pytest.raises(TopologyError) as err:
        parse_topology(d, "t.yaml")
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_old_files_keep_loading_and_say_what_was_derived():
    t = parse_topology(BASE, "t.yaml")
    cl = t.to_cluster()
    assert cl.gpu_class == ("a40", "custom")
    assert cl.mem_bw[1] == nearest_class(50, 24).mem_bw_gb_s * 1e9
    r = t.resolved().servers
    assert "from class a40" in r[0].derived and "nearest class" in r[1].derived
    assert r[1].mem_bw_gb_s == nearest_class(50, 24).mem_bw_gb_s


def test_a_deployment_in_a_precision_the_gpu_lacks_is_refused():
    from hetroute.deployment import ConstraintViolation, Deployment, Replica
    d = yaml.safe_load(yaml.safe_dump(BASE))
    d["servers"][0]["gpu"] = "v100"
    cl = parse_topology(d, "t.yaml").to_cluster()
    dep = Deployment((Replica(0, 0, Precision.INT4, True), Replica(0, 1, Precision.FP16, True)), 1, 2)
    with pytest.raises(ConstraintViolation, match="v100.*no int4 kernels"):
        dep.check(MIXTRAL, _big_budget(), cl)


def _big_budget():
    from hetroute.deployment import MemoryBudget
    return MemoryBudget(gpu=(1e12, 1e12), cpu=(1e12, 1e12))


def test_kernel_command_prints_one_line_per_token_count():
    r = CliRunner().invoke(app, ["hardware", "kernel", "--gpu", "a40", "--d-model", "4096", "--d-ff",
                                 "11008", "--gated", "--tokens", "1,8,64,512", "--precision", "fp16"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == ["tokens=1", "tokens=8", "tokens=64", "tokens=512"]
    ms = [float(ln.split("ms=")[1]) for ln in lines]
    assert 0.3 < ms[0] < 0.7 and ms[0] <= ms[1] <= ms[2] < ms[3]  # ~0.49 ms measured on an A40
    r = CliRunner().invoke(app, ["hardware", "kernel", "--gpu", "small3:hub", "--d-model", "4096",
                                 "--d-ff", "11008", "--gated", "--tokens", "1"])
    assert r.exit_code == 0 and r.output.strip() == lines[0]  # small3's hub is an A40


@pytest.mark.parametrize("args, expected", [
    (["--gpu", "b200"], "unknown GPU class 'b200'"),
    (["--gpu", "v100", "--precision", "int4"], "precision int4 is not supported"),
    (["--gpu", "a40", "--precision", "fp8"], "--precision: one of fp16, int8, int4"),
    (["--gpu", "small3:nope"], "has no server 'nope'"),
    (["--gpu", "a40", "--tokens", "0"], "--tokens"),
    (["--gpu", "a40", "--d-model", "0"], "--d-model"),
])
def test_kernel_command_bad_input_is_one_line_and_exit_2(args, expected):
    base = {"--d-model": "4096", "--d-ff": "11008"}
    for k in list(base):
        if k in args:
            base.pop(k)
    argv = ["hardware", "kernel", *args] + [x for kv in base.items() for x in kv]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2 and expected in r.output and r.output.count("\n") == 1, r.output


def test_fused_moe_kernels_launch_once_per_precision_per_step():
    svc, _ = _hw_service()
    prec = {0: Precision.FP16, 1: Precision.FP16, 2: Precision.FP16, 3: Precision.INT4}.__getitem__
    steps = {}
    for kind in ("per_expert", "fused"):
        sc = StepScheduler(svc, 0, prec, lambda r: True, scope="layer", moe_kernels=kind)
        for r in range(4):
            sc.submit(Job(0, r, r, r, 0, 0.0))
        steps[kind] = sc.take(0.0).duration
    # four replicas of two precisions: two launch sets saved, nothing else changes
    assert steps["per_expert"] - steps["fused"] == pytest.approx(2 * svc.expert_launch_s(0))
    assert svc.expert_launch_s(0) == 3 * svc.devices[0].launch_s
    one = [StepScheduler(svc, 0, prec, lambda r: True, moe_kernels=k) for k in ("per_expert", "fused")]
    for sc in one:
        sc.submit(Job(0, 0, 0, 0, 0, 0.0))
    assert one[0].take(0.0).duration == one[1].take(0.0).duration
    with pytest.raises(ValueError, match="moe_kernels"):
        StepScheduler(svc, 0, prec, lambda r: True, moe_kernels="grouped")


@pytest.mark.parametrize("kind", ["per_expert", "fused"])
def test_published_backlog_is_the_queued_steps_cost_under_either_launch_rule(kind):
    """What a server publishes (its queued work) is what the steps will take, so a
    router reading it under ``fused`` is not told 15 us per further replica too much."""
    svc, _ = _hw_service()
    prec = {0: Precision.FP16, 1: Precision.FP16, 2: Precision.FP16, 3: Precision.INT4,
            4: Precision.INT4, DENSE: Precision.FP16}.__getitem__
    sc = StepScheduler(svc, 0, prec, lambda r: r != 4, scope="layer", max_batch_tokens=3,
                       moe_kernels=kind)
    for tok in range(5):  # two layers; layer 0 holds 5 tokens over a cap of 3 (a partial take)
        for r in (tok % 3, 3, 4) if tok % 2 else (tok % 3, DENSE):
            sc.submit(Job(0, r, tok, tok, tok, float(tok) * 1e-6, prio=float(tok)))
        sc.submit(Job(1, (tok + 1) % 5, tok, tok, 0, 0.0, prio=10.0 + tok))
    whole, t = 0, 1.0
    while sc.queue:
        before, queued = sc.queued_s, len(sc.queue[sc._next_key()])
        step = sc.take(t)  # each step when the one before has ended, as a backend runs them
        t += step.duration
        sc.finish()
        if len(step.jobs) == queued:  # a whole layer: its estimate was exactly this step
            whole += 1
            assert sc.queued_s == pytest.approx(before - step.duration, abs=1e-12), step.layer
    assert sc.steps == 4 and whole == 2  # the cap split each layer once
    assert sc.queued_s == 0.0


def _overlap_step(load_overlap, resident=lambda r: r != 1, before=None, now=0.0):
    """Layer 0: replica 0 (GPU) for two tokens, replica 1 (CPU-resident) for one, a third
    token's dense part; ``before`` queues copies on the engine first."""
    svc, cl = _hw_service()
    sc = StepScheduler(svc, 0, lambda r: Precision.FP16, resident, scope="layer",
                       load_overlap=load_overlap)
    if before:
        before(sc)
    for tok in range(2):
        sc.submit(Job(0, 0, tok, tok, 0, now))
    sc.submit(Job(0, 1, 0, 0, 0, now))
    sc.submit(Job(0, DENSE, 2, 2, 3, now))
    return sc.take(now), svc, MIXTRAL.expert_bytes[Precision.FP16] / (cl.pcie[0] * 0.8)


def test_a_load_on_the_copy_engine_overlaps_the_steps_other_work():
    """``load_overlap: copy_engine``: the stream runs the dense part and the GPU-resident
    expert while replica 1 is copied, then replica 1's kernel; ``serial`` adds the load."""
    fp16 = Precision.FP16
    serial, svc, load = _overlap_step("serial")
    overlap, _, _ = _overlap_step("copy_engine")
    k0, k1 = svc.expert_s(0, fp16, 2), svc.expert_s(0, fp16, 1)
    dense, shared = svc.dense_s(0, 1, 4, 4), svc.expert_launch_s(0)
    assert serial.duration == pytest.approx(load + k0 + k1 + dense - shared, rel=1e-12)
    assert load > k0 + dense  # a 352 MB expert over PCIe outlasts the rest of the step
    assert overlap.duration == pytest.approx(load + k1 - shared, rel=1e-12)
    assert serial.duration - overlap.duration == pytest.approx(k0 + dense, rel=1e-9)
    assert overlap.loads == serial.loads == 1
    assert [j.gpu for j in overlap.jobs if j.replica != DENSE] == [True, True, False]
    # no CPU-resident replica: the two rules are the same step, to the bit
    a, _, _ = _overlap_step("serial", resident=lambda r: True)
    b, _, _ = _overlap_step("copy_engine", resident=lambda r: True)
    assert a.duration == b.duration


def test_a_steps_load_waits_for_a_prefetch_in_flight_or_queues_behind_others():
    fp16 = Precision.FP16
    # replica 1's own prefetch is half way at the step's start: the step waits for its rest
    inflight, svc, load = _overlap_step(
        "copy_engine", before=lambda sc: sc.copy.prefetch(1, 0.0, load_of(sc)), now=0.5 * LOAD)
    k1, shared = svc.expert_s(0, fp16, 1), svc.expert_launch_s(0)
    assert load == pytest.approx(LOAD)
    assert inflight.duration == pytest.approx(0.5 * load + k1 - shared, rel=1e-9)
    # another replica's prefetch holds the engine: replica 1's copy queues behind it (FIFO)
    behind, _, _ = _overlap_step("copy_engine", before=lambda sc: sc.copy.prefetch(7, 0.0, load_of(sc)))
    assert behind.duration == pytest.approx(2 * load + k1 - shared, rel=1e-9)
    # prefetches queued behind the copy in progress: the step's load goes first (on demand)
    # and they move back by its time
    queued = {}

    def two(sc, replicas=(5, 6)):
        queued.update({r: sc.copy.prefetch(r, 0.0, load_of(sc)) for r in replicas})
    ahead, _, _ = _overlap_step("copy_engine", before=two, now=0.5 * LOAD)
    assert ahead.duration == pytest.approx(1.5 * load + k1 - shared, rel=1e-9)
    assert queued[5].version == 0 and queued[5].end == pytest.approx(load)  # in progress: runs on
    assert queued[6].version == 1 and queued[6].end == pytest.approx(3 * load)  # behind the load
    # replica 1's own prefetch, queued and not started, is brought forward as the step's load
    queued.clear()
    mine, _, _ = _overlap_step("copy_engine", before=lambda sc: two(sc, (5, 1, 6)), now=0.5 * LOAD)
    assert mine.duration == pytest.approx(1.5 * load + k1 - shared, rel=1e-9)
    assert queued[1].version == 1 and queued[1].demand and queued[1].end == pytest.approx(2 * load)
    assert queued[6].version == 0 and queued[6].end == pytest.approx(3 * load)  # 1's slot, taken
    # the serial rule shares the engine too: the stream, reaching replica 1 after replica 0's
    # kernel, waits for the rest of its prefetch, or behind another replica's copy, then
    # runs the rest of the step (no second link for the prefetches)
    dense = svc.dense_s(0, 1, 4, 4)
    k0 = svc.expert_s(0, fp16, 2)
    serial, _, _ = _overlap_step("serial", before=lambda sc: sc.copy.prefetch(1, 0.0, load_of(sc)),
                                 now=0.5 * LOAD)
    assert serial.duration == pytest.approx(0.5 * load + k1 + dense - shared, rel=1e-9)
    queued.clear()
    serial, _, _ = _overlap_step("serial", before=two, now=0.5 * LOAD)
    assert serial.duration == pytest.approx(1.5 * load + k1 + dense - shared, rel=1e-9)
    assert queued[6].version == 1 and queued[6].end == pytest.approx(3 * load)
    idle, _, _ = _overlap_step("serial")
    assert idle.duration == pytest.approx(load + k0 + k1 + dense - shared, rel=1e-12)
    # ``prefetch_link: own`` (the rule before 2026-12-05): the load in full, whatever the
    # prefetches' engine holds
    svc_, _ = _hw_service()
    own = StepScheduler(svc_, 0, lambda r: fp16, lambda r: r != 1, scope="layer",
                        prefetch_link="own")
    own.copy.prefetch(5, 0.0, LOAD)
    own.copy.prefetch(1, 0.0, LOAD)
    for tok in range(2):
        own.submit(Job(0, 0, tok, tok, 0, 0.5 * LOAD))
    own.submit(Job(0, 1, 0, 0, 0, 0.5 * LOAD))
    own.submit(Job(0, DENSE, 2, 2, 3, 0.5 * LOAD))
    assert own.take(0.5 * LOAD).duration == idle.duration
    assert [c.version for c in own.copy.queue] == [0, 0]  # the prefetches untouched


def test_serial_a_prefetch_that_lands_before_the_stream_reaches_its_replica_is_not_loaded_again():
    """Serial rule: replica 1 is not resident at the step's start, but its prefetch ends
    while the stream runs replica 0's kernel: when the stream reaches replica 1 its weights
    are on the GPU, so the step pays no copy for it (the rule first charged a second full
    load here, where the emulator's late-running loop often saw the landing already)."""
    fp16 = Precision.FP16
    svc, _ = _hw_service()
    k0 = svc.expert_s(0, fp16, 2)
    k1, shared, dense = svc.expert_s(0, fp16, 1), svc.expert_launch_s(0), svc.dense_s(0, 1, 4, 4)
    now = LOAD - 0.5 * k0  # the prefetch (0 .. LOAD) lands half way through replica 0's kernel
    landed, _, _ = _overlap_step("serial", before=lambda sc: sc.copy.prefetch(1, 0.0, load_of(sc)),
                                 now=now)
    assert landed.duration == pytest.approx(k0 + k1 + dense - shared, rel=1e-12)
    assert landed.loads == 1  # its weights still came over PCIe during the step
    # still under way when the stream gets there: the rest of it is waited for
    now = LOAD - 2 * k0
    waits, _, _ = _overlap_step("serial", before=lambda sc: sc.copy.prefetch(1, 0.0, load_of(sc)),
                                now=now)
    assert waits.duration == pytest.approx(2 * k0 + k1 + dense - shared, rel=1e-9)
    # a prefetch that landed before the step started and whose replica was evicted since
    # (not resident at the start) is no copy of it: loaded in full
    evicted, _, _ = _overlap_step("serial", before=lambda sc: sc.copy.prefetch(1, 0.0, load_of(sc)),
                                  now=LOAD + k0)
    assert evicted.duration == pytest.approx(LOAD + k0 + k1 + dense - shared, rel=1e-12)


def load_of(sc):
    return sc.svc.load_s(0, Precision.FP16)


LOAD = MIXTRAL.expert_bytes[Precision.FP16] / (load_topology("small3").to_cluster().pcie[0] * 0.8)


def test_load_overlap_is_refused_where_steps_hold_one_replica_and_left_out_at_default():
    from testbed.spec import SpecError, parse_spec
    svc, _ = _hw_service()
    with pytest.raises(ValueError, match="load_overlap"):
        StepScheduler(svc, 0, lambda r: Precision.FP16, lambda r: True, scope="replica",
                      load_overlap="copy_engine")
    with pytest.raises(ValueError, match="load_overlap"):
        StepScheduler(svc, 0, lambda r: Precision.FP16, lambda r: True, load_overlap="async")
    with pytest.raises(SpecError, match="engine.load_overlap.*physics: hardware"):
        parse_spec({"physics": "paper", "engine": {"load_overlap": "copy_engine"}})
    assert "load_overlap" not in parse_spec({}).to_yaml()  # earlier runs' resolved specs hold
    # the copy engine's rule is written into every hardware-world resolved spec (a run made
    # when prefetches had a link of their own is not taken for one made under it), not into
    # the paper's world's, whose rule did not change
    assert "prefetch_link: shared" in parse_spec({}).to_yaml()
    assert "prefetch_link" not in parse_spec({"physics": "paper"}).to_yaml()
    with pytest.raises(SpecError, match="engine.prefetch_link.*physics: hardware"):
        parse_spec({"physics": "paper", "engine": {"prefetch_link": "own"}})
    with pytest.raises(SpecError, match="prefetch_link.*load_overlap: serial"):
        parse_spec({"engine": {"prefetch_link": "own", "load_overlap": "copy_engine"}})
    assert "load_overlap" in parse_spec({}).to_yaml(full=True)
    assert "load_overlap: copy_engine" in parse_spec(
        {"engine": {"load_overlap": "copy_engine"}}).to_yaml()


def test_a_steps_loads_run_one_after_another_on_the_copy_engine():
    """Two CPU-resident replicas in one step: their copies share the one link (the second
    starts when the first ends), the first kernel runs while the second is copied."""
    svc, cl = _hw_service()
    fp16 = Precision.FP16
    sc = StepScheduler(svc, 0, lambda r: fp16, lambda r: False, scope="layer",
                       load_overlap="copy_engine")
    pf = sc.copy.prefetch(9, 0.0, LOAD)  # a prefetch in progress at the step's start ...
    later = sc.copy.prefetch(8, 0.0, LOAD)  # ... and one queued behind it
    for r in (1, 2):
        sc.submit(Job(0, r, r, r, 0, 0.1 * LOAD))
    step = sc.take(0.1 * LOAD)
    k, shared = svc.expert_s(0, fp16, 1), svc.expert_launch_s(0)
    # copies: 9 until L, then 1 until 2L, 2 until 3L (ahead of 8); kernels: 1 hides under 2's copy
    assert step.duration == pytest.approx(3 * LOAD + k - shared - 0.1 * LOAD, rel=1e-9)
    assert step.loads == 2 and pf.version == 0 and later.version == 2  # pushed back twice
    assert later.start == pytest.approx(3 * LOAD) and later.end == pytest.approx(4 * LOAD)
    assert sc.copy.free == pytest.approx(4 * LOAD)


@pytest.mark.parametrize("rule", ["serial", "copy_engine"])
def test_every_prefetch_lands_when_steps_loads_move_the_copy_queue(rule):
    """MoE-Infinity with a cache too small for Switch's experts prefetches and loads on
    demand over one copy engine per server: prefetches pushed back or brought forward by a
    step's load still land, so no server's decider is left counting a copy in flight."""
    from testbed.records import RecordWriter
    from testbed.setup import build_setup
    from testbed.sim.backend import SimBackend
    from testbed.spec import parse_spec
    spec = parse_spec({"topology": "small3", "router": {"name": "moe-infinity"},
                       "memory": {"gpu_share": 0.05}, "engine": {"load_overlap": rule},
                       "workload": {"model": "switch", "duration_s": 0.8, "warmup_s": 0.1,
                                    "rate_per_s": 20, "calibration_tokens": 64, "gen_tokens": 0}})
    setup = build_setup(spec)
    writer = RecordWriter(None, setup.shape.top_k)
    sim = SimBackend(setup, writer)
    moved = []
    for sc in sim.sched:
        sc.copy.notify = lambda c, land=sim._landing: (moved.append(c.demand), land(c))
    st = sim.run()
    assert st.failed_requests == 0 and st.token_layers > 0
    assert len(moved) > 0 and any(moved) and not all(moved)  # brought forward and pushed back
    assert all(not d.inflight for d in sim.deciders)  # every prefetch landed
    assert all(not sc.copy.queue or sc.copy.queue[-1].end <= st.sim_time_s for sc in sim.sched)
