"""Speculative decoding: draft (a draft model or prompt lookup), then verify every draft in one target pass."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusteropt_cli.core.serve.engine import _Seq


def _ngram_draft(tokens: list[int], n_max: int, k: int) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the trailing n-gram and propose what followed it."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), 0, -1):
        tail = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class SpeculativeDecoding:
    """The engine's speculative step (a part of Engine: the scheduler calls _spec_step when few sequences run)."""

    # ---- speculative decoding ----------------------------------------------------------------------------
    def _spec_step(self, seqs: list[_Seq]) -> None:
        from clusteropt_cli.core.serve.device_sampling import speculative_accept

        k_max = self.config.num_speculative_tokens
        budgets = {}
        for seq in seqs:
            room = min(seq.max_new - len(seq.out) - 1, self.max_model_len - seq.length - 1)
            early = seq.req.min_tokens and len(seq.out) < seq.req.min_tokens
            budgets[seq.rid] = 0 if (early or not seq.req.speculative) else max(0, min(k_max, room))
        drafts, draft_probs = self._draft(seqs, budgets)
        packed = [(s.slot, s.num_computed, [s.last_token()] + drafts[s.rid]) for s in seqs]
        wanted = [list(range(1 + len(drafts[s.rid]))) for s in seqs]
        logits = self.runner.forward_packed(packed, wanted)
        # every row's processed distribution at the position of the token it chooses
        row_slots = [s.slot for s, rows in zip(seqs, wanted, strict=True) for _ in rows]
        row_pos = [s.length + j for s, rows in zip(seqs, wanted, strict=True) for j in range(len(rows))]
        scaled, args, pos = self.runner.sampler.processed(logits, row_slots, row_pos)
        row = 0
        for seq in seqs:
            k = len(drafts[seq.rid])
            window = slice(row, row + k + 1)
            try:
                tokens = speculative_accept(scaled[window], {n: v[window] for n, v in args.items()}, pos[window],
                                            drafts[seq.rid], draft_probs.get(seq.rid), seq.settings)
            except Exception as exc:  # noqa: BLE001 - this request's fault alone
                self._fault(seq, exc)
                tokens = []
            row += k + 1
            accepted = len(tokens) - 1
            old_len = seq.length
            seq.num_computed += len(tokens)
            if self.pool is not None:
                self._register_blocks(seq)
            if self.draft_runner is not None:
                seq.draft_computed = min(seq.draft_computed, old_len + min(accepted, max(k - 1, 0)))
            seq.drafted += k
            seq.accepted += accepted
            self.stats.spec_drafted += k
            self.stats.spec_accepted += accepted
            self._emit(seq, tokens)
        self.stats.spec_steps += 1

    def _draft(self, seqs: list[_Seq], budgets: dict[str, int]) -> tuple[dict[str, list[int]], dict[str, Any]]:
        drafts: dict[str, list[int]] = {s.rid: [] for s in seqs}
        probs: dict[str, Any] = {}
        if self.draft_runner is None:
            n = int(self.config.prompt_lookup or 0)
            for seq in seqs:
                if budgets[seq.rid]:
                    drafts[seq.rid] = _ngram_draft(seq.all_ids(), n, budgets[seq.rid])
            return drafts, probs
        import torch

        from clusteropt_cli.core.serve.device_sampling import draft_sample

        active = [s for s in seqs if budgets[s.rid] > 0]
        if not active:
            return drafts, probs
        runner = self.draft_runner
        sampler = self.runner.sampler  # the target's row settings (same slots)
        packed, wanted = [], []
        for seq in active:
            ids = seq.all_ids()
            catch_up = ids[seq.draft_computed :]
            packed.append((seq.slot, seq.draft_computed, catch_up))
            wanted.append([len(catch_up) - 1])
        logits = runner.forward_packed(packed, wanted)
        step_rows: dict[str, list[Any]] = {s.rid: [] for s in active}
        for seq in active:
            seq.draft_computed = seq.length
        current = active
        row_logits = logits
        for j in range(max(budgets[s.rid] for s in active)):
            scaled, args, pos = sampler.processed(row_logits, [s.slot for s in current],
                                                  [s.length + j for s in current])
            sampled, row_probs = draft_sample(scaled, args, pos)
            greedy = scaled.argmax(-1).tolist()
            sampled = sampled.tolist()
            picks = []
            for i, seq in enumerate(current):
                if seq.temperature <= 0:
                    tok = greedy[i]
                else:
                    tok = sampled[i]
                    step_rows[seq.rid].append(row_probs[i])
                drafts[seq.rid].append(tok)
                picks.append(tok)
            nxt = [(s, t) for s, t in zip(current, picks, strict=True) if len(drafts[s.rid]) < budgets[s.rid]]
            if not nxt:
                break
            current = [s for s, _ in nxt]
            positions = [s.length + j for s in current]
            row_logits = runner.forward_decode([s.slot for s in current], positions, [t for _, t in nxt])
            for s in current:
                s.draft_computed += 1
        for seq in active:
            if step_rows[seq.rid]:
                probs[seq.rid] = torch.stack(step_rows[seq.rid])
        return drafts, probs
