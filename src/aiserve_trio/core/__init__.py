"""The request's vocabulary, importable by every module: errors, the OpenAI wire types,
deadlines and budgets, messages, the tenant rule, sliced CPU work, TOML decoding.
"""
