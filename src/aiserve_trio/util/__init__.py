"""Process and content utilities that know nothing of a request: file limits, the garbage
collector, Redis connections, lexical vectors, intent labels, WAV files.
"""
