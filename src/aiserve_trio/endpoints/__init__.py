"""The endpoints besides the chat routes that the app answers itself: probes, metrics,
admin, token counting, embeddings.
"""
