"""A sampling CPU profile of the worker it runs in, taken while the worker keeps serving.

The sampler is a timer signal, as Go's pprof does it: ``setitimer(ITIMER_PROF)``
sends ``SIGPROF`` every ``interval`` of the process's CPU time, and the Python
handler -- run by the interpreter on the main thread, which is the Trio thread
under hypercorn -- records the stack it interrupted. Nothing runs between
samples, so the cost is the samples (about 10 us each) and not, as with a
profile hook on every call and return (pyinstrument's own ``Profiler``), a
share of every call: that halved the gateway's throughput (docs/benchmarks.md,
profiling cost).

What makes the stacks Trio-aware is one synthetic frame inserted where the run
loop steps a task: ``[stage sse]``, ``[route models]`` or ``[task <name>]``,
read from the running task's :data:`~.annotate.TASK_LABEL`. The flame graph
then splits the worker's CPU time first by stage, across requests, and shows
the run loop's own work (scheduling, ``epoll``) beside it.

pyinstrument renders the result (its ``Session`` and renderers): speedscope
JSON, or its HTML flame graph. Rendering happens off the event loop
(``trio.to_thread``), so a large profile does not stall the worker it describes.
The HTML page is self-contained (script and styles inline) except for one web
font stylesheet it would fetch from a CDN; that load is removed and a
Content-Security-Policy forbids any other (:data:`HTML_CSP`).

Limits: CPU time of every thread drives the timer, but only the main thread's
stack is recorded (work in ``trio.to_thread`` workers shows as whatever the
main thread was doing); a worker whose Trio loop is not on the main thread
cannot be profiled this way (signals are delivered to the main thread).
"""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
import time
import types
from typing import Any, Literal

import trio
from pyinstrument.renderers import HTMLRenderer, SpeedscopeRenderer
from pyinstrument.session import Session

from .annotate import TASK_LABEL

Format = Literal["speedscope", "html"]
FORMATS: tuple[Format, ...] = ("speedscope", "html")
#: A sample per millisecond of CPU time.
DEFAULT_INTERVAL = 0.001
#: For the HTML page's response: inline script and styles, data: URLs, nothing fetched.
HTML_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline' data:; "
    "img-src data:; font-src data:; base-uri 'none'; form-action 'none'"
)
# The run loop's function that steps a task: the task's frames sit right above it.
_STEP_FUNCTION = "unrolled_run"
_TRIO_RUN_FILE = "_core/_run.py"
# pyinstrument's page loads its web fonts from a CDN; the system fonts do as well.
_WEB_FONT = re.compile(r"https://fonts\.googleapis\.com/css[^\"'`]*")

Stack = tuple[types.CodeType, ...]


class ProfilerBusy(Exception):
    """``SIGPROF`` already has a handler (another profiler in this process)."""


class ProfilerUnavailable(Exception):
    """Not on the main thread: the signal handler cannot be installed from here."""


class SignalSampler:
    """Samples the main thread's stack on ``SIGPROF``; see the module docstring.

    Samples are counted by (stack of code objects, task marker): memory grows
    with the number of distinct stacks, not with the length of the profile.
    """

    def __init__(self, interval: float = DEFAULT_INTERVAL) -> None:
        self.interval = interval
        self.counts: dict[tuple[Stack, str | None], int] = {}
        self.samples = 0
        self._previous: Any = signal.SIG_DFL
        self._wall0 = self._cpu0 = 0.0
        self.running = False

    def _sample(self, signum: int, frame: types.FrameType | None) -> None:
        codes = []
        while frame is not None:
            codes.append(frame.f_code)
            frame = frame.f_back
        key = (tuple(codes), _task_marker())
        self.counts[key] = self.counts.get(key, 0) + 1
        self.samples += 1

    def start(self) -> None:
        """Install the handler and start the timer.

        Raises:
            ProfilerUnavailable: not called on the main thread.
            ProfilerBusy: ``SIGPROF`` is taken.
        """
        if threading.current_thread() is not threading.main_thread():
            raise ProfilerUnavailable("profiling needs the worker's main thread")
        if signal.getsignal(signal.SIGPROF) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            raise ProfilerBusy("SIGPROF already has a handler in this process")
        self._previous = signal.signal(signal.SIGPROF, self._sample)
        self._wall0, self._cpu0 = time.time(), time.process_time()
        signal.setitimer(signal.ITIMER_PROF, self.interval, self.interval)
        self.running = True

    def stop(self) -> Session:
        """Stop the timer, restore the handler, and return the samples as a pyinstrument session."""
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, self._previous or signal.SIG_DFL)
        self.running = False
        return self.session(time.time() - self._wall0, time.process_time() - self._cpu0)

    def session(self, wall: float, cpu: float) -> Session:
        """The samples so far as a pyinstrument :class:`Session`.

        Each sample weighs an equal share of the CPU time measured: the kernel
        delivers the timer at most once per scheduler tick, so the samples are
        fewer than ``cpu / interval`` and ``interval`` would undercount.
        """
        weight = cpu / self.samples if self.samples else self.interval
        idents: dict[types.CodeType, str] = {}
        records: list[tuple[list[str], float]] = []
        for (codes, marker), n in self.counts.items():
            stack = []
            for code in reversed(codes):  # root first
                ident = idents.get(code)
                if ident is None:
                    ident = idents[code] = _identifier(code)
                stack.append(ident)
                if marker is not None and code.co_name == _STEP_FUNCTION and (
                    code.co_filename.replace("\\", "/").endswith(_TRIO_RUN_FILE)
                ):
                    stack.append(marker)
            records.append((stack, n * weight))
        return Session(
            frame_records=records,
            start_time=self._wall0,
            duration=wall,
            min_interval=self.interval,
            max_interval=self.interval,
            sample_count=self.samples,
            # The stem every stack shares is trimmed from the tree down to this frame.
            start_call_stack=records[0][0][:1] if records else [],
            target_description=f"aiserve-trio worker: {self.samples} samples, "
            f"{cpu:.2f} s CPU in {wall:.1f} s",
            cpu_time=cpu,
            sys_path=sys.path,
            sys_prefixes=Session.current_sys_prefixes(),
        )


def _identifier(code: types.CodeType) -> str:
    """pyinstrument's frame identifier: function, file, first line; the class as an attribute."""
    ident = f"{code.co_name}\x00{code.co_filename}\x00{code.co_firstlineno}"
    owner, _, _ = code.co_qualname.rpartition(".")
    return f"{ident}\x01c{owner}" if owner else ident


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
    return f"[{what}]\x00<trio task>\x000"


async def profile_worker(seconds: float, interval: float = DEFAULT_INTERVAL) -> Session:
    """Sample this worker for ``seconds``; the timer stops also when cancelled.

    Raises:
        ProfilerUnavailable, ProfilerBusy: see :meth:`SignalSampler.start`.
    """
    sampler = SignalSampler(interval)
    sampler.start()
    try:
        await trio.sleep(seconds)
    finally:
        session = sampler.stop()
    return session


def render(session: Session, fmt: Format) -> bytes:
    """The profile as speedscope JSON or a self-contained HTML page (CPU-bound: use a thread)."""
    if fmt == "speedscope":
        # Every frame: speedscope's own views zoom into small ones (pyinstrument
        # would drop frames under 1 % of the total).
        text: str = SpeedscopeRenderer(processor_options={"filter_threshold": 0}).render(session)
        doc = json.loads(text)
        # pyinstrument ends the profile at the wall-clock duration; the samples add up
        # to CPU time, and speedscope would draw the difference as empty time.
        for profile in doc["profiles"]:
            profile["endValue"] = max((e["at"] for e in profile["events"]), default=0.0)
        return json.dumps(doc).encode()
    # resample_interval=0: no resampling, and no message printed to stderr.
    page: str = HTMLRenderer(resample_interval=0).render(session)
    return offline_html(page).encode()


def offline_html(page: str) -> str:
    """pyinstrument's page with its web-font load removed and a CSP that forbids any load."""
    page = _WEB_FONT.sub("data:text/css,", page)
    meta = f'<meta http-equiv="Content-Security-Policy" content="{HTML_CSP}">'
    return page.replace("<head>", "<head>\n" + meta, 1)
