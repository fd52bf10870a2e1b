"""``channel-shaping``: shape the reply for the channel it is going to.

Driven by ``ctx.channel`` (the ``X-Channel`` header); configurable per channel::

    [policies.channel-shaping.ivr]
    style = "speech"          # speakable plain text, one sentence at a time
    max_chars = 300           # a sentence longer than this is cut at a space
    url_phrase = "the link in our app"
    [policies.channel-shaping.wechat]
    style = "messages"        # size-bounded messages
    max_bytes = 2000          # UTF-8 bytes per message (WeChat's limit is 2048)
    separator = "\\n\\n"       # between messages, for the relay to split on
    strip_markdown = true

Channels without a table are left alone; the defaults above apply to ``ivr``
and ``wechat`` when the policy's table does not mention them.

Both shapers are sans-IO and decide only on complete sentences, so their
output does not depend on how the reply was chunked. ``speech``: markdown
marks, emoji and URLs go (a URL becomes ``url_phrase`` instead of being read
letter by letter), and text is emitted one complete sentence at a time.
``messages``: sentences are packed into messages of at most ``max_bytes``.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Annotated, Any, Self

import msgspec
import regex

from ..core.decoding import convert
from ..core.errors import ConfigError
from .base import (
    BuildContext,
    OutputFilter,
    Policy,
    PolicyContext,
    PolicyKind,
    PolicySettings,
    Table,
)

# A sentence ends after CJK end punctuation, or after . ! ? followed by white
# space (so "3.85" and "e.g.x" do not end one), or at a line break.
_BOUNDARY = regex.compile(
    r"[。！？；]+[”’」』)]*"  # noqa: RUF001
    # not the "1." of a numbered list item at the start of a line
    r"|(?<!^[ \t]{0,8}[0-9]{1,3})[.!?;]+[\"')\]]*(?=\s)"
    r"|\n",
    regex.MULTILINE,
)
_FENCE = regex.compile(r"^\s*```.*$", regex.MULTILINE)
_IMAGE = regex.compile(r"!\[([^\]\n]{0,200})\]\([^)\s]{0,2000}\)")
_LINK = regex.compile(r"\[([^\]\n]{0,200})\]\([^)\s]{0,2000}\)")
_URL = regex.compile(r"(?:https?://|www\.)[^\s<>()\[\]]{1,2000}?(?=[.,;:!?)\]]*(?:\s|$))")
_LINE_MARK = regex.compile(r"^\s{0,8}(?:#{1,6}\s+|>\s?|[-*+•]\s+|\d{1,3}[.)]\s+)")
_RULE = regex.compile(r"^\s*(?:[-*_]\s*){3,}$")
_EMPHASIS = regex.compile(r"\*{1,3}|_{2,3}|~~|`+")
_TABLE = regex.compile(r"\s*\|\s*")
_SPACE = regex.compile(r"[ \t\r\f\v]+")
# What a removal (an emoji, a markdown mark) leaves behind: a space before closing
# punctuation ("[EMAIL] ." from "[EMAIL] 😀."), brackets with nothing left inside,
# and punctuation with no words before it at the start of a sentence.
_SPACE_BEFORE_MARK = regex.compile(r"\s+(?=[.,!?;:%)\]}。，！？；：、）」』])")  # noqa: RUF001
_EMPTY_BRACKETS = regex.compile(r"\(\s*\)|（\s*）")  # noqa: RUF001
_LEADING_MARKS = regex.compile(r"^[\s.,!?;:。，！？；：、]+")  # noqa: RUF001
_CJK = regex.compile(r"[\p{Han}\p{Hiragana}\p{Katakana}\p{Hangul}]")


def is_emoji(ch: str) -> bool:
    """Pictographs, dingbats, flags, variation selectors and joiners: nothing to say aloud."""
    o = ord(ch)
    if 0x1F000 <= o <= 0x1FAFF or 0x2600 <= o <= 0x27BF or 0x1F1E6 <= o <= 0x1F1FF:
        return True
    if o in (0xFE0F, 0xFE0E, 0x200D, 0x20E3) or 0xE0020 <= o <= 0xE007F:
        return True
    return unicodedata.category(ch) == "So"


def strip_markdown(text: str) -> str:
    """Markdown marks out, link texts kept (per sentence or line)."""
    text = _FENCE.sub("", text)
    text = _IMAGE.sub(r"\1", text)
    text = _LINK.sub(r"\1", text)
    if _RULE.match(text):
        return ""
    text = _LINE_MARK.sub("", text)
    text = _EMPHASIS.sub("", text)
    return str(_TABLE.sub(", ", text).strip(", ")) if "|" in text else text


def speakable(sentence: str, url_phrase: str) -> str:
    """One sentence as plain text a speech engine reads well."""
    text = strip_markdown(sentence)
    text = _URL.sub(url_phrase, text)
    text = "".join(ch for ch in text if not is_emoji(ch))
    text = _EMPTY_BRACKETS.sub("", _SPACE.sub(" ", text.replace("\n", " ")))
    text = _SPACE_BEFORE_MARK.sub("", _SPACE.sub(" ", text))
    return str(_LEADING_MARKS.sub("", text).strip())


def _split(buf: str, bol: bool) -> tuple[list[str], str, bool]:
    """Complete sentences (each with its end mark), the unfinished rest, and
    whether the rest starts a line (``bol``: whether ``buf`` does)."""
    # A synthetic first char tells the boundary pattern whether a line starts
    # here, so that the result does not depend on where earlier text was cut.
    text = ("\n" if bol else " ") + buf
    out, at = [], 1
    for m in _BOUNDARY.finditer(text, 1):
        if m.end() == len(text) and not m.group().endswith("\n"):
            break  # "。" at the end of what has arrived: more marks or quotes may follow
        out.append(text[at : m.end()])
        at = m.end()
    if out:
        bol = out[-1].endswith("\n")
    return out, text[at:], bol


def _cut(text: str, limit: int) -> int:
    """Where to cut an over-long sentence: the last space or comma before ``limit``."""
    for sep in (", ", "，", "、", " "):  # noqa: RUF001
        at = text.rfind(sep, 0, limit)
        if at > 0:
            return at + len(sep)
    return limit


class SpeechShaper:
    """IVR: plain speakable text, emitted one complete sentence at a time."""

    __slots__ = ("_bol", "_buf", "max_chars", "max_holdback", "url_phrase")

    def __init__(self, max_chars: int = 300, url_phrase: str = "the link in our app") -> None:
        self._buf = ""
        self._bol = True
        self.max_chars = max_chars
        self.url_phrase = url_phrase
        self.max_holdback = max_chars

    def _say(self, sentence: str) -> str:
        said = speakable(sentence, self.url_phrase)
        if not said:
            return ""
        if sentence.endswith("\n") and said[-1].isalnum():
            said += "。" if _CJK.match(said[-1]) else "."  # a line is a sentence: let TTS pause
        cjk_end = _CJK.match(said[-1]) or said[-1] in "。！？；"  # noqa: RUF001
        return said if cjk_end else said + " "

    def _pieces(self, sentence: str) -> list[str]:
        """A sentence cut where an over-long one is always cut (see ``feed``)."""
        out = []
        while len(sentence) > self.max_chars:
            at = _cut(sentence, self.max_chars)
            out.append(sentence[:at])
            sentence = sentence[at:]
        return [*out, sentence]

    def feed(self, text: str) -> str:
        self._buf += text
        sentences, self._buf, self._bol = _split(self._buf, self._bol)
        # A complete sentence longer than max_chars is cut exactly as the same
        # text would have been cut while it was still arriving: where it is cut
        # must not depend on how the reply was split into reads.
        pieces = [p for s in sentences for p in self._pieces(s)]
        while len(self._buf) > self.max_chars:
            at = _cut(self._buf, self.max_chars)
            pieces.append(self._buf[:at])
            self._buf = self._buf[at:]
            self._bol = False
        return "".join(self._say(s) for s in pieces)

    def finish(self) -> str:
        rest, self._buf = self._buf, ""
        return self._say(rest).rstrip() if rest else ""


class MessageShaper:
    """WeChat: sentences packed into messages of at most ``max_bytes`` (UTF-8)."""

    __slots__ = (
        "_bol",
        "_buf",
        "_msg",
        "_sent",
        "markdown",
        "max_bytes",
        "max_holdback",
        "separator",
    )

    def __init__(self, max_bytes: int = 2000, separator: str = "\n\n", markdown: bool = True):
        self._buf = ""  # the unfinished sentence
        self._bol = True
        self._msg = ""  # complete sentences not yet sent
        self._sent = False
        self.max_bytes = max_bytes
        self.separator = separator
        self.markdown = markdown
        self.max_holdback = max_bytes

    def _pieces(self, sentence: str) -> list[str]:
        """A sentence, cut into pieces that fit a message."""
        out = []
        while len(sentence.encode()) > self.max_bytes:
            limit = len(sentence.encode()[: self.max_bytes].decode("utf-8", "ignore"))
            at = _cut(sentence, limit)
            out.append(sentence[:at])
            sentence = sentence[at:]
        return [*out, sentence]

    def _flush(self) -> str:
        msg, self._msg = self._msg.strip(), ""
        if not msg:
            return ""
        out = (self.separator if self._sent else "") + msg
        self._sent = True
        return out

    def _add(self, sentences: list[str]) -> str:
        out = []
        for s in sentences:
            s = strip_markdown(s) + ("\n" if s.endswith("\n") else "") if self.markdown else s
            if not s.strip() and (not self._msg or self._msg.endswith("\n\n")):
                continue  # blank lines: at most one empty line in a row
            for piece in self._pieces(s):
                if len((self._msg + piece).strip().encode()) > self.max_bytes:
                    out.append(self._flush())
                self._msg += piece
        return "".join(out)

    def feed(self, text: str) -> str:
        self._buf += text
        sentences, self._buf, self._bol = _split(self._buf, self._bol)
        # Cut where the whole text would be cut, whatever the chunking: a
        # complete sentence is cut (before its markdown goes) exactly as the
        # same text is cut while it is still arriving.
        pieces = [p for s in sentences for p in self._pieces(s)]
        if len(self._buf.encode()) > self.max_bytes:
            *done, self._buf = self._pieces(self._buf)
            pieces += done
            self._bol = False
        return self._add(pieces)

    def finish(self) -> str:
        rest, self._buf = self._buf, ""
        out = self._add([rest]) if rest else ""
        return out + self._flush()


class SpeechStyle(Table, frozen=True, tag="speech", tag_field="style"):
    """``style = "speech"``: speakable plain text, one sentence at a time."""

    #: A sentence longer than this is cut at a space.
    max_chars: Annotated[int, msgspec.Meta(gt=0)] = 300
    #: Said instead of a URL.
    url_phrase: str = "the link in our app"

    def shaper(self) -> OutputFilter:
        """A fresh shaper for one reply."""
        return SpeechShaper(self.max_chars, self.url_phrase)


class MessagesStyle(Table, frozen=True, tag="messages", tag_field="style"):
    """``style = "messages"``: size-bounded messages."""

    #: UTF-8 bytes per message.
    max_bytes: Annotated[int, msgspec.Meta(gt=0)] = 2000
    #: Between messages, for the relay to split on.
    separator: str = "\n\n"
    strip_markdown: bool = True

    def shaper(self) -> OutputFilter:
        """A fresh shaper for one reply."""
        return MessageShaper(self.max_bytes, self.separator, self.strip_markdown)


ChannelStyle = SpeechStyle | MessagesStyle
_STYLES = {"speech": SpeechStyle, "messages": MessagesStyle}
DEFAULT_STYLES: dict[str, ChannelStyle] = {"ivr": SpeechStyle(), "wechat": MessagesStyle()}


class ChannelShaping(Policy):
    content_only = True

    """Output policy choosing a shaper by the request's channel."""

    def __init__(self, styles: Mapping[str, ChannelStyle]) -> None:
        self.styles = dict(styles)

    def output_filter(self, ctx: PolicyContext) -> OutputFilter | None:
        style = self.styles.get(ctx.channel)
        return style.shaper() if style is not None else None


class ChannelShapingSettings(PolicySettings, frozen=True):
    """``[policies.channel-shaping.CHANNEL]`` tables: a style per channel."""

    channels: dict[str, ChannelStyle] = msgspec.field(default_factory=dict)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], *, source: str, key: str) -> Self:
        """Decode one style table per channel (the table is keyed by channel name).

        Raises:
            ConfigError: naming ``policies.NAME.CHANNEL.key``.
        """
        channels: dict[str, ChannelStyle] = {}
        for channel, style in table.items():
            at = f"{key}.{channel}"
            # The style picks the Struct; say what it may be (msgspec would say only "invalid").
            name = style.get("style") if isinstance(style, dict) else None
            if isinstance(style, dict) and name not in _STYLES:
                why = f"must be 'speech' or 'messages', got {name!r}"
                raise ConfigError(f"{source}: key `{at}.style`: {why}")
            channels[channel] = convert(style, ChannelStyle, source=source, key=at)
        return cls(channels=channels)


def channel_shaping(name: str, settings: ChannelShapingSettings, ctx: BuildContext) -> Policy:
    """Factory: the configured channels' styles over the defaults (``ivr``, ``wechat``).

    Raises:
        ConfigError: a channel that is not in ``server.channels``.
    """
    for channel in settings.channels:
        if channel not in ctx.channels:
            known = ", ".join(ctx.channels)
            key = f"policies.{name}.{channel}"
            raise ConfigError(f"{ctx.source}: unknown key `{key}` (known channels: {known})")
    styles = {ch: s for ch, s in DEFAULT_STYLES.items() if ch in ctx.channels}
    return ChannelShaping({**styles, **settings.channels})


KINDS: dict[str, PolicyKind[Any]] = {
    "channel-shaping": PolicyKind(channel_shaping, ChannelShapingSettings),
}
