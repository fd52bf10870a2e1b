"""Recording real traffic: each chat request as one JSON line, labelled by its meaning.

``[record]`` in the config switches it on (``settings.py``). The request path
only offers each finished request's :class:`~aiserve_trio.stages.outcome.Outcome`
to the :class:`~.recorder.Recorder` (a ``send_nowait`` into a bounded channel);
a writer task in the app's lifetime nursery builds the lines (``line.py``:
redaction, labels from ``labels.py``) and writes them to rotating files. The
format of a line is ``schema.py``; ``aiserve-replay`` (``aiserve_trio.replay``)
reads it.

This ``__init__`` imports nothing, so that the config can import
``record.settings`` without pulling in the recorder.
"""
