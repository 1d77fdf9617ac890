"""Compression scorers, dynamic selection, calibration, clustering and budget profiles.

- `scorers`      per-(KV head, token) importance of one layer (SnapKV, Expected Attention, KeyDiff,
                 TOVA, H2O, StreamingLLM), one signature, registry `SCORERS` / `get_scorer`;
- `selection`    dynamic Ada-SnapKV selection (per layer and cross-layer) and uniform top-k;
- `pilot_data`   calibration inputs (ShareGPT, haystack essays, generated long tasks);
- `calibration`  implicit retention over pilot samples -> mean, std, static budgets;
- `clustering`   budget-aware and adjacent head grouping, memory accounting;
- `profile`      the versioned `BudgetProfile` file, `to_layout`, shipped profiles;
- `report`       Spearman stability, overflow rate, box plot.
"""
