"""``python -m analysis beside`` and ``arrivals``: a sweep that varies one setting beside the figure's own."""

from __future__ import annotations

import pandas as pd

from analysis.beside import compare_table


def _runs(rows):
    return pd.DataFrame(rows, columns=["router.name", "workload.rate_per_s", "workload.arrival_cv",
                                       "seed", "mean_ms", "sla_ratio"])


def test_each_point_is_averaged_over_its_seeds_and_set_against_poisson():
    base = _runs([("a", 10, None, 0, 100.0, 0.9), ("a", 10, None, 1, 300.0, 0.7),
                  ("b", 10, None, 0, 50.0, 1.0), ("b", 10, None, 1, 50.0, 1.0)])
    other = _runs([("a", 10, 2.0, 0, 300.0, 0.5), ("a", 10, 2.0, 1, 500.0, 0.3),
                   ("a", 10, 4.0, 0, 1000.0, 0.1), ("b", 10, 2.0, 0, 25.0, 1.0),
                   ("b", 10, 2.0, 1, 25.0, 1.0)])
    t = compare_table(base, other, "workload.arrival_cv", "mean_ms").splitlines()
    assert t[0] == "| router | req/s | Poisson mean ms | arrival_cv 2 | arrival_cv 4 |"
    assert t[2] == "| a | 10 | 200 | 400 (2.00x) | 1000 (5.00x) [1 seeds] |"
    assert t[3] == "| b | 10 | 50 | 25 (0.50x) | - |"
    sla = compare_table(base, other, "workload.arrival_cv", "sla_ratio").splitlines()
    assert sla[2] == "| a | 10 | 0.80 | 0.40 | 0.10 [1 seeds] |"


def test_a_setting_axis_of_names_is_labelled_and_each_seed_is_set_against_its_own():
    cols = ["router.name", "workload.rate_per_s", "engine.load_overlap", "seed", "mean_ms"]
    base = pd.DataFrame([("a", 10, None, 0, 100.0), ("a", 10, None, 1, 300.0)], columns=cols)
    other = pd.DataFrame([("a", 10, "copy_engine", 0, 90.0), ("a", 10, "copy_engine", 1, 330.0)],
                         columns=cols)
    t = compare_table(base, other, "engine.load_overlap", "mean_ms", base_label="figure's",
                      by_seed=True).splitlines()
    assert t[0] == "| router | req/s | figure's mean ms | load_overlap copy_engine |"
    assert t[2] == "| a | 10 | 200 | 210 (1.05x; seeds 0.90-1.10x) |"

    # a seed missing on one side: the ratio is over the seeds both have
    short = other[other.seed == 1]
    t = compare_table(base, short, "engine.load_overlap", "mean_ms", base_label="figure's",
                      by_seed=True).splitlines()
    assert t[2] == "| a | 10 | 200 | 330 (1.10x; seeds 1.10-1.10x) [1 seeds] |"


def test_a_figure_without_a_load_axis_is_keyed_by_its_own_axes():
    # Fig. 8 (routers only) and Fig. 7 (model, router): one key, or another pair
    cols = ["router.name", "engine.attention", "seed", "mean_ms"]
    base = pd.DataFrame([("a", None, 0, 100.0), ("b", None, 0, 50.0)], columns=cols)
    other = pd.DataFrame([("a", "causal", 0, 300.0), ("b", "causal", 0, 50.0)], columns=cols)
    t = compare_table(base, other, "engine.attention", "mean_ms", keys=("router.name",),
                      base_label="figure's", by_seed=True).splitlines()
    assert t[0] == "| router | figure's mean ms | attention causal |"
    assert t[2:] == ["| a | 100 | 300 (3.00x; seeds 3.00-3.00x) |",
                     "| b | 50 | 50 (1.00x; seeds 1.00-1.00x) |"]
    base.insert(0, "workload.model", "m")
    other.insert(0, "workload.model", "m")
    t = compare_table(base, other, "engine.attention", "mean_ms",
                      keys=("workload.model", "router.name")).splitlines()
    assert t[0] == "| model | router | Poisson mean ms | attention causal |"
    assert t[2] == "| m | a | 100 | 300 (3.00x) |"
