"""Algorithm 2, lines 4-29, compiled with numba: the same decisions as the Python reference.

``SetLevelRouter.route`` runs ``route_kernel`` by default; ``Alg2Params(compiled=False)``
runs the readable reference in ``algorithm2.py``/``search.py``. The kernel is a
line-by-line port over flat arrays, and keeps every floating-point expression
in the reference's order of evaluation (``a + b + c`` is ``(a + b) + c``), its
tie-breaking (first minimum in candidate order, stable sort in the beam) and
its work counter, so the two return the same assignment bit for bit;
``tests/test_decision_equivalence.py`` checks that over recorded trajectories.
Why compiled: a Qwen-shaped decision (k = 4 of 60 experts) runs a beam search
of ~150 children, ~125 us in Python; Property 5 is about exactly that cost.

Layouts (built by ``SetLevelRouter._build_tables``):
- ``ctab[c]`` = (server, replica, mode, guarded, load, comp, svc, dq, replica on GPU) per
  candidate;
  with ``cost_model: hardware`` its marginal twin is row ``c + twin_off``.
- ``pools[e, kind]`` = (start, end) rows of expert e's exact, substitute and
  fallback candidates.
- ``la[row]`` = the aggregation look-ahead of eq. (11): row ``l + 1`` for a
  layer l before the last, row ``L + home`` for the last layer.
- ``reach`` = alive (row 0) and link_up (rows 1..N), read only when not ``faultless``.
- ``fp`` = (-, window, lambda, w_off, w_cq, c_q, tau_loc); ``ip`` = (-, -, R, B,
  set_level, fast_path, exchange, -, twin_off).
Output: ``out[:k]`` replicas, ``out[k:2k]`` modes, ``out[2k]`` the aggregation
server, ``out[2k+1]`` evaluations, ``out[2k+2]`` status: 0, or 1 when a target
has no reachable full-precision replica (``out[0]`` = its expert); the rest is
scratch. Returns (estimated delay, quality increment).
"""

from __future__ import annotations

import numpy as np
from numba import njit

INF = np.inf
SRV, REP, MODE, GUARD, LOAD, COMP, SVC, DQ, GPU = range(9)
EXACT = 0
EXACT_POOL, SUB_POOL, FALLBACK_POOL = 0, 1, 2


@njit(cache=True)
def _reachable(alive, link_up, src, dst):
    if not alive[dst]:
        return False
    return src == dst or (link_up[src, dst] and link_up[dst, src])


@njit(cache=True)
def _admissible(ctab, start, end, twin_off, pending, theta, slack_eps, admitted, cap,
                faultless, alive, link_up, buf, j):
    """Guards (18)/(19) and reachability, candidate by candidate (``_admissible``)."""
    cnt = 0
    for i in range(start, end):
        c = i
        if twin_off >= 0 and pending[int(ctab[i, REP])]:
            c = i + twin_off
        s = int(ctab[c, SRV])
        if ctab[c, DQ] <= slack_eps and admitted[s] + ctab[c, SVC] <= cap:
            if faultless or _reachable(alive, link_up, theta, s):
                buf[j, cnt] = c
                cnt += 1
    return cnt


@njit(cache=True)
def _aggregator(has, tr, la):
    """Eq. (11) over the servers flagged in ``has``, ascending, first minimum."""
    best = -1
    best_c = INF
    N = has.shape[0]
    for n in range(N):
        if not has[n]:
            continue
        if best < 0:
            best = n
        cst = la[n]
        for m in range(N):
            if has[m] and m != n:
                cst += tr[m, n]
        if cst < best_c:
            best, best_c = n, cst
    return best


@njit(cache=True)
def _fan_in(has, tr, agg):
    fin = 0.0
    for n in range(has.shape[0]):
        if has[n] and n != agg and tr[n, agg] > fin:
            fin = tr[n, agg]
    return fin


@njit(cache=True)
def _evaluate(ctab, chosen, k, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, has, branch,
              load, res):
    """``LayerProblem.evaluate``: objective, delay and aggregator, or INF if infeasible."""
    has[:] = False
    dq = 0.0
    for j in range(k):
        c = chosen[j]
        dq += ctab[c, DQ]
        if ctab[c, GUARD] != 0.0:
            n = int(ctab[c, SRV])
            load[n] = (load[n] if has[n] else 0.0) + ctab[c, SVC]
            has[n] = True
    if dq > slack_eps:
        res[0], res[1], res[2] = INF, INF, -1.0
        return
    for n in range(has.shape[0]):
        if has[n] and bl[n] + load[n] > cap:
            res[0], res[1], res[2] = INF, INF, -1.0
            return
    has[:] = False
    dq = 0.0
    for j in range(k):
        c = chosen[j]
        n = int(ctab[c, SRV])
        branch[n] = (branch[n] if has[n] else q[n]) + wo * ctab[c, LOAD] + wc * ctab[c, COMP]
        has[n] = True
        dq += ctab[c, DQ]
    agg = _aggregator(has, tr, la)
    fan_out = 0.0
    bmax = -INF
    for n in range(has.shape[0]):
        if has[n]:
            if n != theta and tr[theta, n] > fan_out:
                fan_out = tr[theta, n]
            if branch[n] > bmax:
                bmax = branch[n]
    delay = fan_out + bmax + _fan_in(has, tr, agg)
    res[0], res[1], res[2] = delay + lam * dq, delay, float(agg)


@njit(cache=True)
def _job(ctab, c, wo, wc):
    return wo * ctab[c, LOAD] + wc * ctab[c, COMP]


@njit(cache=True)
def _pairs(ctab, buf, counts, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, has, out,
           res):
    """``_enumerate_pairs``: k = 2, first minimum in product order."""
    best_obj, best_delay, best_agg = INF, INF, -1
    b0, b1i = -1, -1
    for a in range(counts[0]):
        c1 = buf[0, a]
        n1 = int(ctab[c1, SRV])
        bb1 = q[n1] + wo * ctab[c1, LOAD] + wc * ctab[c1, COMP]
        f1 = tr[theta, n1] if n1 != theta else 0.0
        g1 = ctab[c1, GUARD] != 0.0
        for b in range(counts[1]):
            c2 = buf[1, b]
            n2 = int(ctab[c2, SRV])
            bb2 = q[n2] + wo * ctab[c2, LOAD] + wc * ctab[c2, COMP]
            j2 = wo * ctab[c2, LOAD] + wc * ctab[c2, COMP]
            f2 = tr[theta, n2] if n2 != theta else 0.0
            dq = ctab[c1, DQ] + ctab[c2, DQ]
            if dq > slack_eps:
                continue
            g2 = ctab[c2, GUARD] != 0.0
            if n1 == n2:
                if g1 and g2:
                    if bl[n1] + ctab[c1, SVC] + ctab[c2, SVC] > cap:
                        continue
                elif g1 != g2:
                    if bl[n1] + (ctab[c1, SVC] if g1 else ctab[c2, SVC]) > cap:
                        continue
                delay = f1 + bb1 + j2
                agg = n1
            else:
                has[:] = False
                has[n1] = True
                has[n2] = True
                agg = _aggregator(has, tr, la)
                fo = f1 if f1 > f2 else f2
                br = bb1 if bb1 > bb2 else bb2
                other = n2 if agg == n1 else n1
                delay = fo + br + tr[other, agg]
            obj = delay + lam * dq
            if obj < best_obj:
                best_obj, best_delay, best_agg, b0, b1i = obj, delay, agg, c1, c2
    if b0 < 0:
        return False
    out[0], out[1] = b0, b1i
    res[0], res[1], res[2] = best_obj, best_delay, float(best_agg)
    return True


@njit(cache=True)
def _dfs(ctab, buf, counts, k, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, has, branch,
         has_l, load, out, res):
    """``_enumerate_dfs``: product order with bound pruning; returns the leaf count."""
    has[:] = False
    has_l[:] = False
    pos = np.full(k, -1, np.int64)
    applied = np.zeros(k, np.bool_)
    prev_hb = np.zeros(k, np.bool_)
    prev_b = np.zeros(k, np.float64)
    prev_hl = np.zeros(k, np.bool_)
    prev_l = np.zeros(k, np.float64)
    used_l = np.zeros(k, np.bool_)
    srv = np.zeros(k, np.int64)
    dqs = np.zeros(k + 1)
    fos = np.zeros(k + 1)
    bms = np.zeros(k + 1)
    chosen = np.zeros(k, np.int64)
    best_obj, best_delay, best_agg = INF, INF, -1
    found = False
    leaves = 0
    j = 0
    while j >= 0:
        if applied[j]:
            n = srv[j]
            has[n] = prev_hb[j]
            branch[n] = prev_b[j]
            if used_l[j]:
                has_l[n] = prev_hl[j]
                load[n] = prev_l[j]
            applied[j] = False
        pos[j] += 1
        if pos[j] >= counts[j]:
            pos[j] = -1
            j -= 1
            continue
        c = buf[j, pos[j]]
        n = int(ctab[c, SRV])
        sv = ctab[c, SVC] if ctab[c, GUARD] != 0.0 else 0.0
        ndq = dqs[j] + ctab[c, DQ]
        if ndq > slack_eps:
            continue
        nl = 0.0
        if sv != 0.0:
            nl = (load[n] if has_l[n] else 0.0) + sv
            if bl[n] + nl > cap:
                continue
        nb = (branch[n] if has[n] else q[n]) + (wo * ctab[c, LOAD] + wc * ctab[c, COMP])
        cfo = tr[theta, n] if n != theta else 0.0
        fo = fos[j]
        nfo = fo if fo > cfo else cfo
        bmax = bms[j]
        nbmax = bmax if bmax > nb else nb
        if nfo + nbmax + lam * ndq >= best_obj:
            continue
        srv[j] = n
        prev_hb[j], prev_b[j] = has[n], branch[n]
        has[n] = True
        branch[n] = nb
        used_l[j] = sv != 0.0
        if sv != 0.0:
            prev_hl[j], prev_l[j] = has_l[n], load[n]
            has_l[n] = True
            load[n] = nl
        applied[j] = True
        chosen[j] = c
        if j == k - 1:
            leaves += 1
            agg = _aggregator(has, tr, la)
            delay = nfo + nbmax + _fan_in(has, tr, agg)
            obj = delay + lam * ndq
            if obj < best_obj:
                best_obj, best_delay, best_agg = obj, delay, agg
                out[:k] = chosen
                found = True
        else:
            dqs[j + 1], fos[j + 1], bms[j + 1] = ndq, nfo, nbmax
            j += 1
    if found:
        res[0], res[1], res[2] = best_obj, best_delay, float(best_agg)
    else:
        res[0] = INF
    return leaves


@njit(cache=True)
def _beam(ctab, buf, counts, k, width, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, out,
          res):
    """``beam_search``: children ranked by the partial objective (marginal cost 20),
    stably sorted, ``width`` kept. Returns the number of children scored, -1-count
    when some level has none."""
    N = tr.shape[0]
    order = np.argsort(counts[:k], kind="mergesort")
    maxc = 0
    for j in range(k):
        if counts[j] > maxc:
            maxc = counts[j]
    cap_children = width * maxc if width * maxc > 1 else 1
    # the beam: parents
    P_ch = np.full((width, k), -1, np.int64)
    P_br = np.zeros((width, N))
    P_hb = np.zeros((width, N), np.bool_)
    P_ld = np.zeros((width, N))
    P_hl = np.zeros((width, N), np.bool_)
    P_dq = np.zeros(width)
    P_fo = np.zeros(width)
    P_bm = np.zeros(width)
    P_obj = np.zeros(width)
    P_agg = np.full(width, -1, np.int64)
    n_par = 1
    # children, as (parent, candidate) with their new scalars
    C_par = np.zeros(cap_children, np.int64)
    C_c = np.zeros(cap_children, np.int64)
    C_obj = np.zeros(cap_children)
    C_dq = np.zeros(cap_children)
    C_fo = np.zeros(cap_children)
    C_bm = np.zeros(cap_children)
    C_nb = np.zeros(cap_children)
    C_nl = np.zeros(cap_children)
    C_agg = np.zeros(cap_children, np.int64)
    has = np.zeros(N, np.bool_)
    Q_ch = np.empty_like(P_ch)
    Q_br = np.empty_like(P_br)
    Q_hb = np.empty_like(P_hb)
    Q_ld = np.empty_like(P_ld)
    Q_hl = np.empty_like(P_hl)
    evals = 0
    for oi in range(k):
        j = order[oi]
        nc = 0
        for p in range(n_par):
            dq, fo, bmax = P_dq[p], P_fo[p], P_bm[p]
            for t in range(counts[j]):
                c = buf[j, t]
                n = int(ctab[c, SRV])
                sv = ctab[c, SVC] if ctab[c, GUARD] != 0.0 else 0.0
                ndq = dq + ctab[c, DQ]
                if ndq > slack_eps:
                    continue
                nl = 0.0
                if sv != 0.0:
                    nl = (P_ld[p, n] if P_hl[p, n] else 0.0) + sv
                    if bl[n] + nl > cap:
                        continue
                nb = (P_br[p, n] if P_hb[p, n] else q[n]) + (wo * ctab[c, LOAD] + wc * ctab[c, COMP])
                cfo = tr[theta, n] if n != theta else 0.0
                nfo = fo if fo > cfo else cfo
                nbmax = bmax if bmax > nb else nb
                has[:] = P_hb[p]
                has[n] = True
                agg = _aggregator(has, tr, la)
                fin = _fan_in(has, tr, agg)
                C_par[nc], C_c[nc] = p, c
                C_obj[nc] = nfo + nbmax + fin + lam * ndq
                C_dq[nc], C_fo[nc], C_bm[nc], C_nb[nc], C_nl[nc], C_agg[nc] = ndq, nfo, nbmax, nb, nl, agg
                nc += 1
        evals += nc
        if nc == 0:
            return -1 - evals
        rank = np.argsort(C_obj[:nc], kind="mergesort")
        keep = width if nc > width else nc
        for r in range(keep):
            x = rank[r]
            p = C_par[x]
            c = C_c[x]
            n = int(ctab[c, SRV])
            Q_ch[r] = P_ch[p]
            Q_ch[r, j] = c
            Q_br[r] = P_br[p]
            Q_hb[r] = P_hb[p]
            Q_br[r, n] = C_nb[x]
            Q_hb[r, n] = True
            Q_ld[r] = P_ld[p]
            Q_hl[r] = P_hl[p]
            if ctab[c, GUARD] != 0.0 and ctab[c, SVC] != 0.0:
                Q_ld[r, n] = C_nl[x]
                Q_hl[r, n] = True
        for r in range(keep):
            x = rank[r]
            P_ch[r] = Q_ch[r]
            P_br[r] = Q_br[r]
            P_hb[r] = Q_hb[r]
            P_ld[r] = Q_ld[r]
            P_hl[r] = Q_hl[r]
            P_dq[r], P_fo[r], P_bm[r], P_obj[r], P_agg[r] = C_dq[x], C_fo[x], C_bm[x], C_obj[x], C_agg[x]
        n_par = keep
    out[:k] = P_ch[0]
    obj = P_obj[0]
    res[0], res[1], res[2] = obj, obj - lam * P_dq[0], float(P_agg[0])
    return evals


@njit(cache=True)
def _exchange(ctab, buf, counts, k, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, has,
              branch, load, out, res):
    """``one_exchange``: strictly improving single-target moves until none; returns evaluations."""
    cur = out[:k].copy()
    trial = cur.copy()
    ev = np.zeros(3)
    evals = 0
    improved = True
    while improved:
        improved = False
        for j in range(k):
            for t in range(counts[j]):
                c = buf[j, t]
                if c == cur[j]:
                    continue
                trial[:] = cur
                trial[j] = c
                _evaluate(ctab, trial, k, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, has,
                          branch, load, ev)
                evals += 1
                if ev[0] < res[0] - 1e-15:
                    cur[:] = trial
                    res[:] = ev
                    improved = True
    out[:k] = cur
    return evals


@njit(cache=True)
def _per_expert(ctab, buf, counts, k, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, has,
                branch, load, out, res):
    """Remark after Property 4: each target its cheapest candidate by eq. (9)."""
    for j in range(k):
        best = -1
        best_v = INF
        for t in range(counts[j]):
            c = buf[j, t]
            n = int(ctab[c, SRV])
            v = tr[theta, n] + q[n] + (wo * ctab[c, LOAD] + wc * ctab[c, COMP]) + lam * ctab[c, DQ]
            if best < 0 or v < best_v:
                best, best_v = c, v
        out[j] = best
    _evaluate(ctab, out, k, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, has, branch,
              load, res)
    return 1


@njit(cache=True)
def _search(ctab, buf, counts, k, ip, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, has,
            branch, has_l, load, out, res, exchange):
    """``SetLevelRouter._search``; returns (found, evaluations)."""
    if ip[4] == 0:
        ev = _per_expert(ctab, buf, counts, k, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc,
                         has, branch, load, out, res)
        return res[0] != INF, ev
    size = 1
    for j in range(k):
        size *= counts[j]
    if size <= ip[2]:
        return _enumerate(ctab, buf, counts, k, theta, tr, la, q, bl, cap, slack_eps, lam, wo,
                          wc, has, branch, has_l, load, out, res)
    ev = _beam(ctab, buf, counts, k, ip[3], theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc,
               out, res)
    if ev < 0:
        return False, -1 - ev
    if exchange:
        ev += _exchange(ctab, buf, counts, k, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc,
                        has, branch, load, out, res)
    return True, ev


@njit(cache=True)
def _enumerate(ctab, buf, counts, k, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, has,
               branch, has_l, load, out, res):
    """``enumerate_best``; returns (found, evaluations)."""
    if k == 2:
        ok = _pairs(ctab, buf, counts, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, has,
                    out, res)
        return ok, counts[0] * counts[1]
    leaves = _dfs(ctab, buf, counts, k, theta, tr, la, q, bl, cap, slack_eps, lam, wo, wc, has,
                  branch, has_l, load, out, res)
    return res[0] != INF, leaves


@njit(cache=True)
def _dominance(ctab, buf, counts, k, theta, tr, backlog, admitted, fp, slack, chosen, res):
    """Lines 17-18: the all-local exact set when it provably beats every remote option."""
    cq, wo, wc = fp[5], fp[3], fp[4]
    for j in range(k):
        found = False
        for t in range(counts[j]):
            c = buf[j, t]
            if int(ctab[c, SRV]) == theta and int(ctab[c, MODE]) == EXACT and ctab[c, GPU] != 0.0:
                chosen[j] = c
                found = True
                break
        if not found:
            return False
    dq = 0.0
    svc = 0.0
    delay = cq * backlog[theta]
    for j in range(k):
        c = chosen[j]
        dq += ctab[c, DQ]
        svc += ctab[c, SVC]
        delay += wo * ctab[c, LOAD] + wc * ctab[c, COMP]
    if dq > slack + 1e-12 or admitted[theta] + svc > fp[1]:
        return False
    objective = delay + fp[2] * dq
    for j in range(k):
        for t in range(counts[j]):
            c = buf[j, t]
            n = int(ctab[c, SRV])
            if n != theta and tr[theta, n] + cq * backlog[n] + wo * ctab[c, LOAD] + wc * ctab[c, COMP] < objective:
                return False
    res[1], res[2] = delay, float(theta)
    return True


@njit(cache=True)
def route_kernel(ctab, pools, tr, la, targets, backlog, admitted, reach, pending, fp, ip, out,
                 theta, la_row, slack, faultless):
    """One token-layer (see the module docstring for the layouts); returns (delay, dq)."""
    k = targets.shape[0]
    N = tr.shape[0]
    la_row = la[la_row]
    alive = reach[0]
    link_up = reach[1:]
    twin_off = ip[8]
    cap, lam, wo, wc, cq = fp[1], fp[2], fp[3], fp[4], fp[5]
    slack_eps = slack + 1e-12
    maxw = 1
    for j in range(k):
        e = targets[j]
        for kind in range(3):
            w = pools[e, kind, 1] - pools[e, kind, 0]
            if w > maxw:
                maxw = w
    buf = np.empty((k, maxw), np.int64)
    counts = np.zeros(k, np.int64)
    missing = False
    for j in range(k):  # lines 5-15: exact first, substitutes only if none admissible
        e = targets[j]
        cnt = _admissible(ctab, pools[e, EXACT_POOL, 0], pools[e, EXACT_POOL, 1], twin_off, pending,
                          theta, slack_eps, admitted, cap, faultless, alive, link_up, buf, j)
        if cnt == 0:
            cnt = _admissible(ctab, pools[e, SUB_POOL, 0], pools[e, SUB_POOL, 1], twin_off,
                              pending, theta, slack_eps, admitted, cap, faultless, alive, link_up,
                              buf, j)
        if cnt == 0:
            missing = True
        counts[j] = cnt
    evals = 0
    tried_fast = 0
    chosen = out[2 * k + 3:]
    res = np.zeros(3)
    found = False
    if not missing and ip[5] != 0 and ip[4] != 0 and backlog[theta] <= fp[6]:
        evals += 1
        tried_fast = 1
        if _dominance(ctab, buf, counts, k, theta, tr, backlog, admitted, fp, slack, chosen, res):
            found = True
    if not found:
        if cq == 1.0:
            q = backlog
        else:
            q = np.empty(N)
            for n in range(N):
                q[n] = cq * backlog[n]
        has = np.zeros(N, np.bool_)
        branch = np.zeros(N)
        has_l = np.zeros(N, np.bool_)
        load = np.zeros(N)
        if not missing:
            found, ev = _search(ctab, buf, counts, k, ip, theta, tr, la_row, q, admitted, cap,
                                slack_eps, lam, wo, wc, has, branch, has_l, load, chosen, res,
                                ip[6] != 0)
            evals += ev
        if not found:  # lines 24-28: emergency fallback
            fb = np.zeros_like(buf)
            fbc = np.zeros(k, np.int64)
            for j in range(k):
                e = targets[j]
                cnt = 0
                for c in range(pools[e, FALLBACK_POOL, 0], pools[e, FALLBACK_POOL, 1]):
                    if faultless or _reachable(alive, link_up, theta, int(ctab[c, SRV])):
                        fb[j, cnt] = c
                        cnt += 1
                if cnt == 0:  # the reference counts only the fast path's work then
                    out[2 * k + 2] = 1
                    out[2 * k + 1] = tried_fast
                    out[0] = e
                    return 0.0, 0.0
                fbc[j] = cnt
            n_empty = 0
            for j in range(k):
                if counts[j] == 0:
                    n_empty += 1
            if n_empty > 0 and n_empty < k:
                for j in range(k):
                    if counts[j] == 0:
                        buf[j, :fbc[j]] = fb[j, :fbc[j]]
                        counts[j] = fbc[j]
                found, ev = _search(ctab, buf, counts, k, ip, theta, tr, la_row, q, admitted, cap,
                                    slack_eps, lam, wo, wc, has, branch, has_l, load, chosen, res,
                                    ip[6] != 0)
                evals += ev
            if not found:  # every target on a full-precision exact replica (Property 1)
                size = 1
                for j in range(k):
                    size *= fbc[j]
                if size <= ip[2]:
                    found, ev = _enumerate(ctab, fb, fbc, k, theta, tr, la_row, q, admitted, cap,
                                           slack_eps, lam, wo, wc, has, branch, has_l, load,
                                           chosen, res)
                else:
                    ev = _beam(ctab, fb, fbc, k, ip[3], theta, tr, la_row, q, admitted, cap,
                               slack_eps, lam, wo, wc, chosen, res)
                    found = ev >= 0
                    if ev < 0:
                        ev = -1 - ev
                evals += ev
                if not found:
                    out[2 * k + 2] = 2
                    out[2 * k + 1] = tried_fast
                    return 0.0, 0.0
    dq = 0.0
    for j in range(k):
        c = chosen[j]
        out[j] = int(ctab[c, REP])
        out[k + j] = int(ctab[c, MODE])
        dq += ctab[c, DQ]
    out[2 * k] = int(res[2])
    out[2 * k + 1] = evals
    out[2 * k + 2] = 0
    return res[1], dq
