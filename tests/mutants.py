"""Mutation check of the method's tests (issue 15, item 7). Not a test module.

Each mutant below is one deliberate bug, written as a text substitution on one
source file: ``anchor`` (which must occur exactly once in the file) becomes
``replacement``. For every mutant the script copies ``hetroute/`` and
``tests/`` into a temporary directory, applies the substitution there (the
working tree is never touched), runs the mutant's tests with ``pytest -x -q``
and prints whether a test failed (``killed``) or all passed (``SURVIVED``).
Before that it runs the union of the tests on the unmutated copy; if that fails
nothing is judged.

When the code is rewritten, a mutant whose anchor no longer occurs is reported
as ``ANCHOR NOT FOUND`` (``ANCHOR AMBIGUOUS`` if it occurs more than once), with
the file and anchor to look for: find the equivalent line in the new code and
update ``anchor``/``replacement`` here. The ``what`` line says what the bug
is, in words, so the equivalent is findable.

Usage (from the repository root, with the project's Python):
    python tests/mutants.py               # every mutant
    python tests/mutants.py fast_path beam_keeps_worst   # by name (prefix match)
    python tests/mutants.py --list
    python tests/mutants.py --all         # list every test that kills each mutant
    python tests/mutants.py --root DIR    # judge the tests of another checkout
Exit status: 0 if every mutant was killed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ALG2 = "hetroute/routing/algorithm2.py"
KERNEL = "hetroute/routing/compiled.py"
SEARCH = "hetroute/routing/search.py"
FEEDBACK = "hetroute/routing/feedback.py"
ALG1 = "hetroute/placement/algorithm1.py"
DEPLOYMENT = "hetroute/deployment.py"

# both modules run every test on the compiled kernel and on the Python reference
T_ALG2 = ("tests/test_algorithm2.py", "tests/test_routing_search.py",
          "tests/test_decision_equivalence.py::test_compiled_equals_reference_on_random_instances")
T_ALG1 = ("tests/test_algorithm1.py",)
T_FEEDBACK = ("tests/test_feedback.py",)
T_DEPLOYMENT = ("tests/test_deployment.py", "tests/test_algorithm1.py",
                "tests/test_hardware.py::test_a_deployment_in_a_precision_the_gpu_lacks_is_refused")


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    anchor: str
    replacement: str
    tests: tuple[str, ...]


MUTANTS = [
    # -- Algorithm 2: dominance fast path (lines 17-18) --------------------------------
    Mutant("fast_path_unchecked",
           "the dominance fast path returns the local set without checking remote alternatives",
           ALG2,
           "if n != theta and row[n] + cq * bl[n] + wo * c.load + wc * c.comp < objective:",
           "if False:",
           T_ALG2),
    Mutant("fast_path_misreports_delay",
           "the fast path reports est_delay 0 instead of D_{i,l} of its local set",
           ALG2,
           "modes=(Mode.EXACT,) * len(local), next_server=theta, dq=dq,\n"
           "                          est_delay=delay)",
           "modes=(Mode.EXACT,) * len(local), next_server=theta, dq=dq,\n"
           "                          est_delay=0.0)",
           T_ALG2),
    # -- Algorithm 2: beam search (width and selection) ---------------------------------
    Mutant("beam_keeps_worst_sorted",
           "the beam ranks children by decreasing objective (keeps the worst)",
           SEARCH, "children.sort(key=lambda t: t[0])",
           "children.sort(key=lambda t: t[0], reverse=True)", T_ALG2),
    Mutant("beam_keeps_worst_tail",
           "the beam keeps the last `width` children after sorting (the worst)",
           SEARCH, "beam = children[:width]", "beam = children[-width:]", T_ALG2),
    Mutant("beam_unsorted",
           "the beam keeps the first `width` children generated, unranked",
           SEARCH, "children.sort(key=lambda t: t[0])", "pass", T_ALG2),
    Mutant("beam_width_one_inside",
           "beam_search ignores its width and keeps one child (greedy)",
           SEARCH, "beam = children[:width]", "beam = children[:1]", T_ALG2),
    Mutant("beam_width_one_router",
           "the router calls the beam with width 1 instead of B",
           ALG2, "found = beam_search(problem, p.beam_width)",
           "found = beam_search(problem, 1)", T_ALG2),
    Mutant("beam_below_enum_limit",
           "the router beams even when the candidate product is at most R",
           ALG2, "if problem.product_size() <= p.enum_limit:", "if False:", T_ALG2),
    # -- Algorithm 2: emergency fallback (lines 24-28) ----------------------------------
    Mutant("fallback_all_targets",
           "every target falls back when only one lacks a candidate (no partial re-optimisation)",
           ALG2,
           "if any(not c for c in problem.cands) and not all(not c for c in problem.cands):",
           "if False:", T_ALG2),
    # -- Algorithm 2: what the assignment reports ---------------------------------------
    Mutant("substitute_loss_dropped",
           "a substitute's dq omits Q_sub(E, E^) (only the replica's q counts)",
           ALG2, "group.append(cand(r, c.rep_q[r] + loss, Mode.SUBSTITUTE))",
           "group.append(cand(r, c.rep_q[r], Mode.SUBSTITUTE))", T_ALG2),
    Mutant("fallback_misreports_dq",
           "after a fallback, route reports dq = 0 although the other targets' increments count",
           ALG2, "dq = sum(c.dq for c in chosen)",
           "dq = 0.0 if missing else sum(c.dq for c in chosen)", T_ALG2),
    Mutant("fallback_misreports_delay",
           "after a fallback, route reports est_delay 0 instead of D_{i,l}",
           ALG2, "dq=dq, est_delay=ev.delay)", "dq=dq, est_delay=0.0 if missing else ev.delay)",
           T_ALG2),
    Mutant("route_reports_zero_dq",
           "route reports dq = 0 whatever it chose (budget accounting lost)",
           ALG2, "dq = sum(c.dq for c in chosen)", "dq = 0.0", T_ALG2),
    Mutant("pair_enum_detached_replicas",
           "the k=2 enumeration keeps the best objective but the first feasible pair's replicas",
           SEARCH, "best_obj, best_delay, best_agg, best = obj, delay, agg, (c1, c2)",
           "best_obj, best_delay, best_agg, best = obj, delay, agg, best or (c1, c2)", T_ALG2),
    Mutant("dfs_enum_detached_replicas",
           "the k>=3 enumeration keeps the best objective but the first complete set's replicas",
           SEARCH, "best[0], best[1], best[2], best[3] = obj, delay, agg, tuple(chosen)",
           "best[0], best[1], best[2], best[3] = obj, delay, agg, best[3] or tuple(chosen)",
           T_ALG2),
    # -- the same bugs in the compiled kernel every run uses ------------------------------
    Mutant("kernel_fast_path_unchecked",
           "compiled: the fast path returns the local set without checking remote alternatives",
           KERNEL, "if n != theta and tr[theta, n] + cq * backlog[n] + wo * ctab[c, LOAD] + wc * ctab[c, COMP] < objective:",
           "if False:", T_ALG2),
    Mutant("kernel_beam_keeps_worst",
           "compiled: the beam ranks children by decreasing objective (keeps the worst)",
           KERNEL, 'rank = np.argsort(C_obj[:nc], kind="mergesort")',
           'rank = np.argsort(C_obj[:nc], kind="mergesort")[::-1].copy()', T_ALG2),
    Mutant("kernel_beam_width_one",
           "compiled: the router calls the beam with width 1 instead of B",
           KERNEL, "ev = _beam(ctab, buf, counts, k, ip[3], theta",
           "ev = _beam(ctab, buf, counts, k, 1, theta", T_ALG2),
    Mutant("kernel_beam_below_enum_limit",
           "compiled: the router beams even when the candidate product is at most R",
           KERNEL, "    if size <= ip[2]:\n        return _enumerate(",
           "    if False:\n        return _enumerate(", T_ALG2),
    Mutant("kernel_fallback_all_targets",
           "compiled: every target falls back when only one lacks a candidate",
           KERNEL, "if n_empty > 0 and n_empty < k:", "if False:", T_ALG2),
    Mutant("kernel_reports_zero_dq",
           "compiled: route reports dq = 0 whatever it chose",
           KERNEL, "        dq += ctab[c, DQ]\n    out[2 * k] = int(res[2])",
           "        dq += 0.0\n    out[2 * k] = int(res[2])", T_ALG2),
    Mutant("kernel_no_stability_guard",
           "compiled: candidates are admitted without guard (19)",
           KERNEL, "if ctab[c, DQ] <= slack_eps and admitted[s] + ctab[c, SVC] <= cap:",
           "if ctab[c, DQ] <= slack_eps:", T_ALG2),
    # -- feedback rule (21) -------------------------------------------------------------
    Mutant("feedback_sign",
           "eq. (21) with the sign flipped: a component over its target share gets cheaper",
           FEEDBACK, "a + eta * (r - t)", "a + eta * (t - r)", T_FEEDBACK),
    Mutant("feedback_no_step",
           "eq. (21) without the step size eta",
           FEEDBACK, "a + eta * (r - t)", "a + (r - t)", T_FEEDBACK),
    Mutant("feedback_no_clip",
           "eq. (21) without the projection [.]_+",
           FEEDBACK, "max(0.0, a + eta * (r - t))", "(a + eta * (r - t))", T_FEEDBACK),
    Mutant("feedback_no_normalisation",
           "eq. (21) without dividing by the sum (alphas leave the simplex)",
           FEEDBACK, "self.alphas = [x / s for x in raw]", "self.alphas = raw", T_FEEDBACK),
    Mutant("feedback_uniform_targets",
           "target shares fixed at 1/4 instead of the first window's shares",
           FEEDBACK, "self.targets = rho\n",
           "self.targets = [1.0 / len(COMPONENTS)] * len(COMPONENTS)\n", T_FEEDBACK),
    # -- Algorithm 1 --------------------------------------------------------------------
    Mutant("eq13_no_route_probability",
           "eq. (13) weighted by activation frequency pi_E instead of the simulated uses",
           ALG1, "freq = pi[r.expert] if stats is None else stats.replica_uses[i]",
           "freq = pi[r.expert]", T_ALG1),
    Mutant("eq13_no_offload_time",
           "eq. (13) without the offload time v/beta saved",
           ALG1, "out[i] = freq * saved", "out[i] = freq", T_ALG1),
    Mutant("eq14_no_memory_price",
           "eq. (14) without the memory price mu * v",
           ALG1, "return gain - params.memory_price * st.v(c)", "return gain", T_ALG1),
    Mutant("eq14_sign",
           "eq. (14) with C_new - C_old",
           ALG1, "np.maximum(0.0, old[e][:, :u] - new[:, None])",
           "np.maximum(0.0, new[:, None] - old[e][:, :u])", T_ALG1),
    Mutant("eq14_no_quality_term",
           "the offline cost (eq. 9 with empty queues) without lambda * q",
           ALG1, "+ lambda_q * float(quality.q[e, c])", "+ 0.0 * float(quality.q[e, c])", T_ALG1),
    Mutant("stage3_no_guard",
           "Stage 3 without the diminishing-returns guard (second copies scored by g)",
           ALG1, "if has_gpu.get(e):", "if False:", T_ALG1),
    Mutant("stage3_guard_uses_g",
           "Stage 3's guard re-scores a second copy by its g instead of its marginal saving",
           ALG1, "m = min(g[i], marginal(i))", "m = g[i]", T_ALG1),
    # -- Deployment.check ---------------------------------------------------------------
    Mutant("check_noop",
           "Deployment.check checks nothing",
           DEPLOYMENT,
           "also that every replica's precision has kernels on its server's GPU.\"\"\"\n",
           "also that every replica's precision has kernels on its server's GPU.\"\"\"\n"
           "        return\n", T_DEPLOYMENT),
    Mutant("check_no_c1",
           "Deployment.check without (c.1), GPU memory",
           DEPLOYMENT, "if gpu[n] > budget.gpu[n] * (1 + 1e-9):", "if False:", T_DEPLOYMENT),
    Mutant("check_no_c2",
           "Deployment.check without (c.2), CPU memory",
           DEPLOYMENT, "if cpu[n] > budget.cpu[n] * (1 + 1e-9):", "if False:", T_DEPLOYMENT),
    Mutant("check_no_c4",
           "Deployment.check without (c.4), the full-precision replica",
           DEPLOYMENT, "if not self.full_precision(e):", "if False:", T_DEPLOYMENT),
]

COPY = ("hetroute", "tests", "pyproject.toml")


def _copy(root: Path, dst: Path) -> None:
    # __pycache__ is kept: it holds numba's compiled kernels (valid while their source is
    # unchanged), so only a mutant of compiled.py pays the ~25 s compile
    ignore = shutil.ignore_patterns(".hypothesis")
    for name in COPY:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dst / name)


def _present(root: Path, tests: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Test ids whose file (and function, for file::name) exist under root; and the rest."""
    ok, missing = [], []
    for t in tests:
        path, _, fn = t.partition("::")
        f = root / path
        if f.exists() and (not fn or f"def {fn.split('[')[0]}(" in f.read_text()):
            ok.append(t)
        else:
            missing.append(t)
    return ok, missing


def _pytest(work: Path, tests: list[str], stop: bool = True) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(work), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", *(["-x"] if stop else []), "-q",
           "-p", "no:cacheprovider", "-o", "addopts=", "-rf", *tests]
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def _failures(out: str) -> list[str]:
    return [line.split(" - ")[0].split(" ", 1)[1] for line in out.splitlines()
            if line.startswith(("FAILED ", "ERROR "))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="run only mutants whose name starts with one of these")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                    help="checkout whose hetroute/ and tests/ are judged (default: this one)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--all", action="store_true",
                    help="run each mutant's tests to the end and list every failing test "
                         "(slower; default stops at the first)")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or any(m.name.startswith(n) for n in args.names)]
    if args.list:
        for m in chosen:
            print(f"{m.name:30s} {m.file}: {m.what}")
        return 0
    root = args.root.resolve()
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        work = Path(tmp)
        _copy(root, work)
        probe = subprocess.run([sys.executable, "-c", "import hetroute; print(hetroute.__file__)"],
                               cwd=work, env=dict(os.environ, PYTHONPATH=str(work)),
                               capture_output=True, text=True)
        if not probe.stdout.strip().startswith(str(work)):
            print(f"hetroute is not imported from the copy ({probe.stdout.strip()}"
                  f"{probe.stderr.strip()}); aborting")
            return 2
        union = sorted({t for m in chosen for t in m.tests})
        present, missing = _present(work, tuple(union))
        for t in missing:
            print(f"note: {t} does not exist under {root}; skipped")
        t0 = time.monotonic()
        rc, out = _pytest(work, present)
        if rc != 0:
            print(f"the unmutated tests fail (rc {rc}); nothing judged:\n{out[-3000:]}")
            return 2
        print(f"unmutated: {len(present)} test paths pass ({time.monotonic() - t0:.0f} s)\n")
        results = []
        for m in chosen:
            f = work / m.file
            original = f.read_text()
            count = original.count(m.anchor)
            if count != 1:
                status = "ANCHOR NOT FOUND" if count == 0 else f"ANCHOR AMBIGUOUS ({count}x)"
                print(f"{m.name:30s} {status}\n    in {m.file}: {m.anchor!r}\n    ({m.what})")
                results.append((m.name, status))
                continue
            tests, _ = _present(work, m.tests)
            if not tests:
                print(f"{m.name:30s} NO TESTS  none of {', '.join(m.tests)} exists")
                results.append((m.name, "NO TESTS"))
                continue
            f.write_text(original.replace(m.anchor, m.replacement))
            try:
                t0 = time.monotonic()
                rc, out = _pytest(work, tests, stop=not args.all)
            finally:
                f.write_text(original)
            took = time.monotonic() - t0
            if rc == 0:
                status, detail = "SURVIVED", ""
            elif rc == 1:
                status, detail = "killed", "\n    ".join([""] + _failures(out))
            else:
                status, detail = f"ERROR (pytest rc {rc})", "".join(out.strip().splitlines()[-1:])
            print(f"{m.name:30s} {status:9s} {took:5.1f} s  {detail}")
            results.append((m.name, status))
        killed = sum(s == "killed" for _, s in results)
        print(f"\n{killed}/{len(results)} killed")
        for name, s in results:
            if s != "killed":
                print(f"  not killed: {name} ({s})")
        return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
