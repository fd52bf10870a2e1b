"""The gateway's one seam into hypercorn: everything that knows hypercorn's internals.

The rest of the package imports only the names below (``__all__``); a test holds every
other module to that, and to naming no private attribute of hypercorn or h2.

What is replaced
    Two attributes of hypercorn's Trio worker module, which it looks up when it starts
    serving, after the app's lifespan start-up: ``hypercorn.trio.run.TCPServer`` and the
    ``trio`` it builds its listeners with. That start-up calls :func:`install`, which sets
    the first to :class:`~.tcp.GatewayTCPServer` bound to this worker's
    :class:`~.worker.Worker` (``seam.py``), and the second to a view of ``trio`` whose
    ``SocketListener`` accepts every waiting connection at once (``accept.py``: trio's
    takes one a pass of the run loop, and new connections waited seconds under load).
    ``worker_serve``, which builds the listeners, is pinned. Importing the package
    changes nothing. ``AISERVE_HYPERCORN_PATCHES=off`` (:data:`SWITCH`) installs nothing:
    hypercorn as shipped, without the edge guard.

Pinned
    hypercorn 0.18.x (``fingerprints.SUPPORTED``; ``pyproject.toml`` pins the same range)
    and h2 4.4.x (``pyproject.toml``). Every hypercorn and h2 function the seam overrides,
    reimplements or calls privately is fingerprinted in ``fingerprints.PINNED`` (the first
    16 hex digits of the sha256 of its source). :func:`install` checks the version and
    every fingerprint before it replaces anything; on a mismatch it raises
    :class:`SeamRefused` (the app does not start) unless hypercorn's TOML has
    ``aiserve_allow_unpatched = true`` (:data:`ALLOW_UNPATCHED`): an ERROR, and hypercorn
    as shipped.

The subclasses (hypercorn's class in brackets)
    ``tcp.py``: ``GatewayTCPServer`` (``trio.tcp_server.TCPServer``),
    ``GatewayTaskGroup`` (``trio.task_group.TaskGroup``), ``GatewayProtocols``
    (``protocol.ProtocolWrapper``), ``GatewayH11`` (``protocol.h11.H11Protocol``);
    ``h2.py``: ``GatewayH2`` (``protocol.h2.H2Protocol``), ``WindowedBuffer``
    (``protocol.h2.StreamBuffer``), ``GatewayConnection`` and ``AdvertisedLimits`` (h2's
    ``H2Connection`` and ``Settings``); ``worker.py``: ``DatedConfig`` (``config.Config``).
    What they are made of: ``accept.py`` (the listener), ``directio.py`` (socket reads
    and writes), ``idle.py`` (the keep-alive timer), ``coalesce.py`` (HTTP/1.1 writes
    held per ASGI message), ``datecache.py`` (the ``Date`` header once a second), ``disconnect.py``,
    ``preread.py`` (an HTTP/1.1 request left unread while the worker's queue of requests
    starting is full; it reads ``H11Protocol.connection`` and ``.stream``, public).

hypercorn's private names the seam touches (and h2's)
    ``TCPServer._read_data`` (overridden), ``._close``, ``._idle_timeout``,
    ``._initiate_server_close`` (called), ``._task_group`` (set);
    ``TaskGroup._nursery`` (started in) and ``trio.task_group._handle`` (the app's task);
    ``H11Protocol._send_h11_event`` (overridden);
    ``H2Protocol._handle_events``, ``._create_stream``, ``._send_data`` (overridden),
    ``._flush``, ``._window_updated`` (called);
    ``StreamBuffer._complete``, ``._is_empty``, ``._paused`` (``WindowedBuffer``);
    ``Config._quic_addresses`` (read); h2's ``H2Connection._receive_goaway_frame``
    (overridden) and ``._receive_headers_frame`` (relied on). Bound methods looked
    behind (``__self__``): the protocol behind a stream's ``send`` (``tcp.py``), the server
    behind the idle action (``idle.py``), and behind the app's ``receive``, hypercorn's
    lifespan and its queue (``receive.py``).

What the app sees
    :func:`server_config` (hypercorn's config, at start-up) and :func:`queued` (a message
    hypercorn already queued, taken at once); in each HTTP scope's ``extensions``, the
    :class:`ServerCall` that tells the pipeline of a disconnect (:func:`server_call`;
    elsewhere a :class:`ReceiveWatcher` behind the same :class:`Disconnect`) and the
    worker's count of failed authentications (``http.types.STRIKE``, which the gate
    calls), and when the server read the request's head (``http.types.ARRIVED``,
    ``directio.Arrivals``: the request's deadline counts from it), the worker's queue of
    requests starting (``http.types.TURNS``) and the turn taken before the request was
    read (``http.types.TURN``, ``preread.py``); and it reads the
    app's promise that a body follows a response head at once (``http.types.DEFER``).
    On hypercorn as shipped the scope carries none of these, and
    ``DEFER`` is a key hypercorn ignores. The keys the app and the seam share are
    ``http/types.py``'s: ``http/`` and ``security/`` stand below the seam and import
    nothing of it.

State
    None in a module: what a worker keeps across its connections (the edge guard's
    settings and penalty box, the queue of requests starting, the ``Date`` header's
    cache, the config view) is its
    :class:`~.worker.Worker`, made by :func:`install` and passed to each server, task
    group and HTTP/2 protocol it builds. A test holds the seam's modules to that.
"""

from .disconnect import Disconnect, ReceiveWatcher, ServerCall, server_call
from .receive import queued, server_config
from .seam import ALLOW_UNPATCHED, SWITCH, SeamRefused, install, installed, uninstall

__all__ = [
    "ALLOW_UNPATCHED",
    "SWITCH",
    "Disconnect",
    "ReceiveWatcher",
    "SeamRefused",
    "ServerCall",
    "install",
    "installed",
    "queued",
    "server_call",
    "server_config",
    "uninstall",
]
