"""A sampling CPU profile of the worker it runs in, taken while the worker keeps serving.

pyinstrument samples the Trio thread's stack (at most once per ``interval``,
from a C profile hook) without stopping the run loop. Its own async mode
profiles only the task that started it -- here the debug request, asleep --
so it runs with ``async_mode="disabled"`` and sees every task's steps and the
run loop's waits. What makes the stacks Trio-aware is one synthetic frame
inserted where the run loop steps a task: ``[stage sse]``, ``[route models]``
or ``[task <name>]``, read from the task's :data:`~.annotate.TASK_LABEL`. The
flame graph then splits the worker's time first by stage, across requests,
and shows the run loop's own work (scheduling, ``epoll``) beside it.

Only the Trio thread is sampled: work in ``trio.to_thread`` workers (key
verification) is not in the profile.

Rendering happens off the event loop (``trio.to_thread``), so a large profile
does not stall the worker it describes. The HTML page is pyinstrument's
self-contained one (its script and styles inline) with its one network load,
a web font stylesheet, removed, and a Content-Security-Policy that forbids
any other (:data:`HTML_CSP`).
"""

from __future__ import annotations

import re
import sys
import types
from typing import Any, Literal

import trio
from pyinstrument import Profiler
from pyinstrument.renderers import HTMLRenderer, SpeedscopeRenderer
from pyinstrument.session import Session

from .annotate import TASK_LABEL

Format = Literal["speedscope", "html"]
FORMATS: tuple[Format, ...] = ("speedscope", "html")
#: pyinstrument's default: a sample at most every millisecond.
DEFAULT_INTERVAL = 0.001
#: For the HTML page's response: inline script and styles, data: images, nothing fetched.
HTML_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline' data:; "
    "img-src data:; font-src data:; base-uri 'none'; form-action 'none'"
)
#: The run loop's function that steps a task: the task's frames sit right above it.
_STEP_FRAME = "unrolled_run\x00"
_TRIO_RUN_FILE = "_core/_run.py"
# pyinstrument's page loads its web fonts from a CDN; the system fonts do as well.
_WEB_FONT = re.compile(r"https://fonts\.googleapis\.com/css[^\"'`]*")


class TaskProfiler(Profiler):
    """pyinstrument's profiler, every sample marked with the task it was taken in.

    Overrides pyinstrument's sample callback (``_sampler_saw_call_stack``, a
    private method: pyinstrument is pinned to 5.x in pyproject.toml, and the
    tests check the marker frames are there).
    """

    def __init__(self, interval: float = DEFAULT_INTERVAL) -> None:
        super().__init__(interval=interval, async_mode="disabled")

    def _sampler_saw_call_stack(
        self, call_stack: list[str], time_since_last_sample: float, async_state: Any
    ) -> None:
        marker = _task_marker()
        if marker is not None:
            for i, frame in enumerate(call_stack):
                if frame.startswith(_STEP_FRAME) and _TRIO_RUN_FILE in frame:
                    call_stack = [*call_stack[: i + 1], marker, *call_stack[i + 1 :]]
                    break
        super()._sampler_saw_call_stack(call_stack, time_since_last_sample, async_state)


def _task_marker() -> str | None:
    """The synthetic frame for the task running now; None between task steps."""
    try:
        task = trio.lowlevel.current_task()
    except RuntimeError:  # the run loop itself (scheduling, I/O wait)
        return None
    label = task.context.get(TASK_LABEL)
    if label is None:
        what = f"task {task.name}"
    elif label.stage is not None:
        what = f"stage {label.stage}"
    else:
        what = f"route {label.route}"
    # pyinstrument's frame identifier: function, file, line.
    return f"[{what}]\x00<trio task>\x000"


def _root_frame() -> types.FrameType:
    """The outermost frame of this thread: the profile's tree starts there."""
    frame = sys._getframe()
    while frame.f_back is not None:
        frame = frame.f_back
    return frame


async def profile_worker(seconds: float, interval: float = DEFAULT_INTERVAL) -> Session:
    """Sample this worker's Trio thread for ``seconds``; the profiler stops also when cancelled."""
    profiler = TaskProfiler(interval)
    profiler.start(caller_frame=_root_frame(), target_description=f"worker, {seconds:g} s")
    try:
        await trio.sleep(seconds)
    finally:
        session = profiler.stop()
    return session


def render(session: Session, fmt: Format) -> bytes:
    """The profile as speedscope JSON or a self-contained HTML page (CPU-bound: use a thread)."""
    if fmt == "speedscope":
        # Every frame: speedscope's own views zoom into small ones (pyinstrument
        # would drop frames under 1 % of the total).
        doc: str = SpeedscopeRenderer(processor_options={"filter_threshold": 0}).render(session)
        return doc.encode()
    # resample_interval=0: no resampling, and no message printed to stderr.
    page: str = HTMLRenderer(resample_interval=0).render(session)
    return offline_html(page).encode()


def offline_html(page: str) -> str:
    """pyinstrument's page with its web-font load removed and a CSP that forbids any load."""
    page = _WEB_FONT.sub("data:text/css,", page)
    meta = f'<meta http-equiv="Content-Security-Policy" content="{HTML_CSP}">'
    return page.replace("<head>", "<head>\n" + meta, 1)
