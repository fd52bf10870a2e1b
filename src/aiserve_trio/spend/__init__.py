"""Spend: prices (pure), budget periods and checks (pure), the shared spend ledger."""
