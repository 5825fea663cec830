"""copt distill: logit distillation (KL/JSD against a teacher) and chain-of-thought trace distillation.

Modules: `losses` (divergences, top-k, the alpha mix), `vocab` (teacher/student compatibility), `logits`
(`distill logits` on the shared training loop), `traces` (schema, answer extraction, verification, resumable
generation through the serve engine), `sft` (completion-only SFT on traces).
"""
