"""IceCache's index: a DCI tree per KV head over the keys that left the window, and its insert.

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539 (Sec. 3.3, 4.1, App. B.1).

  Eqs. 2-3, T_K / T_Q          DCIForest._project (u.T_K(k)), query_projection (u.T_Q(q)),
                               _similarity (key to key, for parents)
  Alg. 1 lines 26-36, insert   DCIForest.insert: a window page's keys into their parents' pages
  Algorithm 2, DCI-INDEXING    build.py, the bulk build at prefill (DCIForest inherits it)
  Algorithms 3-4, the query    search.py; the levels and u are drawn ahead (promotion.py)

With c >= every key's norm, T_K(k) = [k/c, sqrt(1 - |k|^2/c^2)] and T_Q(q) = [q/|q|, 0] are unit
vectors and |T_Q(q) - T_K(k)|^2 = 2 - 2 q.k/(|q| c): the nearest key has the largest q.k. Between
keys, 1/2 |T_K(a) - T_K(b)|^2 = 1 - sim(a, b)/c^2, sim(a, b) = a.b + sqrt(c^2-|a|^2) sqrt(c^2-|b|^2).

Decisions (docs/design.md, "icecache"; the authors' M-DCI code where the paper is silent):
  * c is the running maximum key norm per head; when it grows every projection is recomputed
    from u[:D].k and |k|^2, so nothing stale survives (q.k itself does not depend on c);
  * a point's parent is its nearest point one level up (largest sim, exactly; ties to the older);
    descent=greedy (pdci.PDCIForest) finds it with the paper's QUERY(k, T, l + 1, 1) instead;
  * an inserted point goes to its parent's open page, a new page when full: no token ever moves;
    a point drawn above the top opens one level (_raise_top): the levels stay gapless.
"""
from __future__ import annotations

import torch

from .build import Build


class DCIForest(Build):
    """One DCI tree per KV head over the same tokens (their keys differ per head). Tree ids are
    insertion order: tree id t is the t-th key inserted. Its state, for at most `cap` points (H KV
    heads, head_dim D, pages of P; allocated in build.py):

      n, top                          points indexed; levels (0: an empty tree)
      u (D + 1,), c (H,)              the projection direction; the running max key norm, float64
      sq, uk, proj (H, cap)           |k|^2 (float64), u[:D].k, u.T_K(k) at the current c
      promoted (cap,)                 the level each point is promoted to, drawn ahead (promotion.py)
      level, pos_in_level (cap,)      each point's level (shared by the heads) and place in level_ids
      parent, page_of, slot_of (H, cap)    each point's parent (-1: the root), page and slot
      slot_keys (H, max_pages P, D)   the keys, page-major: row c P + s is page c's slot s (a point
                                      never changes page, so its row never moves)
      fill, page_token, n_pages       per page its points and their tree ids (H, max_pages[, P]);
                                      pages per head
      open_page [H] {parent: page}    each parent's one page not yet full
    """

    # -- the MIPS transform (Eqs. 2-3) ---------------------------------------------------------
    def _project(self, uk: torch.Tensor, sq: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        # u.T_K(k) = (u[:D].k + u[D] sqrt(c^2 - |k|^2)) / c      uk, sq (H, n), c (H,)
        c = c[:, None].clamp_min(1e-30)
        return ((uk + self.u[-1].double() * (c * c - sq).clamp_min(0).sqrt()) / c).float()

    def query_projection(self, q: torch.Tensor) -> torch.Tensor:
        """u.T_Q(q) for q (R, D) -> (R,)."""
        q = q.float()
        return (q @ self.u[:-1]) / q.norm(dim=-1).clamp_min(1e-30)

    def _similarity(self, a: torch.Tensor, sq_a: torch.Tensor, b: torch.Tensor, sq_b: torch.Tensor) -> torch.Tensor:
        # sim(a, b) = a.b + sqrt(c^2 - |a|^2) sqrt(c^2 - |b|^2): a (H, m, D), sq_a (H, m); b (H, n, D),
        # sq_b (H, n) -> (H, m, n); the nearest under T_K has the largest sim
        c2 = (self.c * self.c)[:, None]
        tail = (c2 - sq_a).clamp_min(0).sqrt()[:, :, None] * (c2 - sq_b).clamp_min(0).sqrt()[:, None, :]
        return torch.bmm(a, b.transpose(1, 2)) + tail.float()

    # -- the keys, in their pages ----------------------------------------------------------------
    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """(H, m) the slot_keys row of tree ids (m,), placed in their pages: page P + slot."""
        return self.page_of[:, ids] * self.P + self.slot_of[:, ids]

    def head_keys(self, h: int, ids: torch.Tensor) -> torch.Tensor:
        """The keys of head h's tree ids (m,) -> (m, D) float32."""
        return self.slot_keys[h, self.page_of[h, ids] * self.P + self.slot_of[h, ids]]

    def key_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The keys of tree ids (m,) (placed in their pages) -> (H, m, D) float32."""
        return self.slot_keys.gather(1, self.rows_of(ids)[:, :, None].expand(-1, -1, self.D))

    def _write_rows(self, ids: torch.Tensor, keys: torch.Tensor) -> None:
        # keys (H, m, D) of tree ids (m,), just placed: into their page rows
        self.slot_keys.scatter_(1, self.rows_of(ids)[:, :, None].expand(-1, -1, self.D), keys.float())

    def _store(self, keys: torch.Tensor) -> None:
        # keys (H, m, D): append points n..n+m-1 (norms, projections; the key rows once placed)
        m, a = keys.shape[1], self.n
        if a + m > self.cap:
            raise ValueError(f"the DCI tree holds at most {self.cap} keys, {a + m} asked")
        k = keys.float()
        sq = k.double().square().sum(-1)  # float64: sqrt(c^2 - |k|^2) of the longest keys is a root near 0
        c = torch.maximum(self.c, sq.amax(dim=1).sqrt())
        if not torch.equal(c, self.c):  # a longer key: c grows, every projection is recomputed exactly
            self.c = c
            self.proj[:, :a] = self._project(self.uk[:, :a], self.sq[:, :a], c)
        self.sq[:, a:a + m] = sq
        self.uk[:, a:a + m] = k @ self.u[:-1]
        self.proj[:, a:a + m] = self._project(self.uk[:, a:a + m], sq, c)

    # -- levels ----------------------------------------------------------------------------------
    def level_ids(self, level: int) -> torch.Tensor:
        """Tree ids on `level`, in insertion order (a point's place in it is pos_in_level)."""
        return self._level_ids.get(level, torch.zeros(0, dtype=torch.int64))

    def _find_parents(self, level: int, keys: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
        """Parents (H, r) on level + 1 of the points run (r,), keys (H, r, D), about to join `level`:
        Alg. 4 with k = 1 at level l + 1, exactly (no point of the run is on level l + 1)."""
        up = self.level_ids(level + 1)
        sim = self._similarity(keys.float(), self.sq[:, run], self.key_rows(up), self.sq[:, up])
        return up[sim.argmax(dim=2)]  # (H, r)

    # -- insertion (Algorithm 1, lines 26-36) ------------------------------------------------------
    def insert(self, keys: torch.Tensor) -> None:
        """Insert keys (H, m, D), in token order (into an empty forest: build, Algorithm 2)."""
        if self.n == 0:
            return self.build(keys)
        a, m = self.n, keys.shape[1]
        self._store(keys)
        levels = self.promoted[a:a + m].tolist()
        t = a
        while t < a + m:  # runs of points on one level: their parents in one product
            level = levels[t - a]
            if level > self.top:
                self._raise_top(t)
                level = self.top
            end = t + 1
            while end < a + m and levels[end - a] == level:
                end += 1
            run = torch.arange(t, end)
            if level == self.top:
                parents = torch.full((self.H, end - t), -1, dtype=torch.int64)  # the root
            else:
                parents = self._find_parents(level, keys[:, t - a:end - a], run)
            ids = self.level_ids(level)  # run joins `level`, after its points
            self.pos_in_level[run] = torch.arange(ids.numel(), ids.numel() + run.numel())
            self.level[run] = level
            self._level_ids[level] = torch.cat((ids, run))
            self.parent[:, run] = parents
            self.n = end
            self._place(run, parents)
            self._write_rows(run, keys[:, t - a:end - a])
            t = end

    def _raise_top(self, t: int) -> None:
        # point t opens level top + 1: the old top level (the root's children) become its
        # children, the root's pages its pages (no token moves), and t becomes the root's child
        self.parent[:, self.level_ids(self.top)] = t
        for h in range(self.H):
            if -1 in self.open_page[h]:
                self.open_page[h][t] = self.open_page[h].pop(-1)
        self.top += 1

    def _place(self, run: torch.Tensor, parents: torch.Tensor) -> None:
        # points run (r,) into their parents' open pages (H, r), a new page where one is full;
        # in token order per head, on Python ints, then written to the tensors at once
        fill, P = self.fill.tolist(), self.P
        heads, tokens, pages, slots = [], [], [], []
        for h, row in enumerate(parents.tolist()):
            open_page = self.open_page[h]
            for t, parent in zip(run.tolist(), row):
                page = open_page.get(parent)
                if page is None or fill[h][page] == P:
                    page = open_page[parent] = self.n_pages[h]
                    self.n_pages[h] += 1
                heads.append(h), tokens.append(t), pages.append(page), slots.append(fill[h][page])
                fill[h][page] += 1
        heads, tokens, pages, slots = (torch.tensor(x, dtype=torch.int64) for x in (heads, tokens, pages, slots))
        self.page_of[heads, tokens], self.slot_of[heads, tokens] = pages, slots
        self.page_token[heads, pages, slots] = tokens
        self.fill[heads, pages] = slots + 1
