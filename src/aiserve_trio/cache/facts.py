"""The facts of a question (pure): what a semantic cache hit may never approximate.

Two questions whose wording is near can still ask different things: a 20-year
mortgage or a 30-year one, 5,000 or 50,000 yuan, a card that was or was *not*
received. :func:`facts` reads them from the text as a canonical list, and the
semantic tier serves an answer only to a question with the same list -- the
similarity of the vectors decides among questions that already agree on it.

What it reads (each a string ``kind:value``; the list is sorted, so the order
the question states them in does not matter, and repeats are kept):

- ``num:N``: every number, in digits (``5,000``, ``5000.00``, full-width digits) or words
  (``twenty``, ``二十``, ``两万``, ``三点五``), with its scale (``5k``, ``1.5
  million``, ``3万``, ``2亿``) -- one value however it is written;
- ``term:Ny`` / ``Nm`` / ``Nw`` / ``Nd``: a number followed by a unit of time
  (``20-year``, ``20 years``, ``30年``, ``6个月``, ``90 days``, ``两周``);
- ``pct:N``: a percentage (``3.5%``, ``3.5 percent``, ``百分之三点五``);
- ``cur:CODE``: a currency, by symbol, code or name (``$``, ``USD``, ``yuan``,
  ``人民币``, ``港币``...);
- ``date:...``: month and weekday names and relative days (``March``, ``星期五``,
  ``tomorrow``, ``明天``) -- the day numbers of a date are ``num`` facts;
- ``mark:KIND[:DIGITS]``: a redaction marker (``[CARD]``, ``[ACCOUNT ****1234]``)
  with the digits it kept, and ``acct:DIGITS`` for a run of 8 or more digits
  (with spaces or dashes) or a masked tail (``****1234``, ``尾号1234``);
- ``product:``, ``tier:``, ``channel:``, ``scope:``, ``party:``: the bank's products
  (``credit card``, ``房贷``...), card tiers, channels, domestic or international,
  and who the question is about (``my wife``, ``儿子``...), from a vocabulary where
  several names of one thing share a value (``mortgage`` = ``home loan`` = ``房贷``);
- ``id:VALUE``: an identifier, a token of letters and digits where a letter comes
  before a digit (``REF-AB12``, ``ORD20251204``, ``A1234``), lower-cased and without its
  dashes -- so ``REF-AB12`` and ``REF-AB13`` differ, as two amounts do, and ``20-year``
  or ``5k`` stay a term and a number;
- ``name:ROLE:VALUE``: a named party or merchant after a role word: in English a
  capitalised name after ``to``, ``for``, ``from``, ``pay``, ``into``, ``named``
  (``pay Zhang Wei``, ``a refund from JD``), in Chinese the name after ``给``, ``向``,
  ``从`` (``给李娜``, ``从京东``); ``ROLE`` is ``from`` after ``from``/``从`` and ``to``
  otherwise. English names are read only in a question that has lower-case letters:
  in text of one case a name cannot be told from a word, and the list stays blind to
  case (a name in lower case is then not a fact: that is the one kind of party the
  guard does not see);
- ``from:FACT`` / ``to:FACT``: the direction of a transfer-like question. A party,
  product, account, marker or identifier stated shortly after ``from``,
  ``out of``, ``从`` or after ``to``, ``into``, ``到``, ``给``, ``转给``, ``转入``, ``向``
  gets that role too, so ``from my wife's account to my son's`` and the reverse (whose
  other facts are equal, and whose vectors are too) are two questions. Currencies
  get no role: ``to $5,000`` and ``5,000 dollars to`` are one amount;
- ``neg``: each negation (``not``, ``n't``, ``no``, ``never``, ``without``,
  ``不``, ``没``/``没有``, ``未``, ``无``, ``别``, ``非``, ``勿``).

It errs towards more facts: a word that only looks like a negation (``不过``)
makes two questions differ, which costs a cache hit, never a wrong answer.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right
from decimal import Decimal, InvalidOperation

_EN_UNITS: dict[str, int | Decimal] = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
    "nineteen": 19, "single": 1, "half": Decimal("0.5"),
}  # fmt: skip
_EN_TENS = {
    "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
    "eighty": 80, "ninety": 90,
}  # fmt: skip
_SCALES = {
    "k": 1_000, "thousand": 1_000, "m": 1_000_000, "mn": 1_000_000, "million": 1_000_000,
    "b": 10**9, "bn": 10**9, "billion": 10**9, "hundred": 100,
    "百": 100, "千": 1_000, "万": 10_000, "萬": 10_000, "亿": 10**8, "億": 10**8,
}  # fmt: skip
_ZH_DIGITS = {
    "零": 0, "\u3007": 0, "一": 1, "壹": 1, "二": 2, "贰": 2, "两": 2, "兩": 2, "三": 3, "叁": 3,
    "四": 4, "肆": 4, "五": 5, "伍": 5, "六": 6, "陆": 6, "七": 7, "柒": 7, "八": 8, "捌": 8,
    "九": 9, "玖": 9,
}  # fmt: skip
_ZH_SMALL = {"十": 10, "拾": 10, "百": 100, "佰": 100, "千": 1_000, "仟": 1_000}
_ZH_BIG = {"万": 10_000, "萬": 10_000, "亿": 10**8, "億": 10**8}

_TERMS = {
    "year": "y", "years": "y", "yr": "y", "yrs": "y", "年": "y", "年期": "y",
    "month": "m", "months": "m", "mo": "m", "mos": "m", "个月": "m", "個月": "m", "月期": "m",
    "week": "w", "weeks": "w", "wk": "w", "周": "w", "週": "w", "星期": "w", "个星期": "w",
    "day": "d", "days": "d", "天": "d",
}  # fmt: skip
_CURRENCIES = {
    "$": "USD", "us$": "USD", "usd": "USD", "dollar": "USD", "dollars": "USD", "美元": "USD",
    "美金": "USD", "¥": "CNY", "￥": "CNY", "rmb": "CNY", "cny": "CNY", "yuan": "CNY",
    "元": "CNY", "块": "CNY", "人民币": "CNY", "€": "EUR", "eur": "EUR", "euro": "EUR",
    "euros": "EUR", "欧元": "EUR", "£": "GBP", "gbp": "GBP", "pound": "GBP", "pounds": "GBP",
    "英镑": "GBP", "hk$": "HKD", "hkd": "HKD", "港币": "HKD", "港元": "HKD", "jpy": "JPY",
    "yen": "JPY", "日元": "JPY", "円": "JPY",
}  # fmt: skip
_DATES = {
    **{m: f"month:{i}" for i, m in enumerate(
        ("january", "february", "march", "april", "", "june", "july", "august",
         "september", "october", "november", "december"), 1) if m},
    **{m: f"month:{i}" for i, m in enumerate(
        ("jan", "feb", "mar", "apr", "", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), 1)
       if m},
    **{d: f"weekday:{i}" for i, d in enumerate(
        ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"), 1)},
    "today": "rel:0", "tonight": "rel:0", "tomorrow": "rel:1", "yesterday": "rel:-1",
    "今天": "rel:0", "今日": "rel:0", "明天": "rel:1", "明日": "rel:1", "昨天": "rel:-1",
    "后天": "rel:2", "前天": "rel:-2", "本月": "relm:0", "下个月": "relm:1", "上个月": "relm:-1",
    "下月": "relm:1", "这个月": "relm:0", "这月": "relm:0", "上月": "relm:-1",
    "今年": "rely:0", "明年": "rely:1", "去年": "rely:-1",
    "next month": "relm:1", "last month": "relm:-1", "this month": "relm:0",
    "next year": "rely:1", "last year": "rely:-1", "this year": "rely:0",
}  # fmt: skip
#: The bank's products, channels and the parties a question is about: a near
#: question about another product or person is another question. Longest first,
#: so ``白金卡`` is not read as ``金卡``; several names of one thing share a value.
_VOCABULARY: dict[str, dict[str, tuple[str, ...]]] = {
    "product": {
        "credit_card": ("credit card", "信用卡"),
        "debit_card": ("debit card", "借记卡", "储蓄卡"),
        "mortgage": ("mortgage", "home loan", "housing loan", "房贷", "住房贷款", "房屋贷款"),
        "car_loan": ("car loan", "auto loan", "车贷", "汽车贷款"),
        "personal_loan": ("personal loan", "个人贷款", "消费贷"),
        "business_loan": ("business loan", "企业贷款", "经营贷"),
        "student_loan": ("student loan", "助学贷款"),
        "savings": ("savings account", "储蓄账户"),
        "checking": ("checking account", "current account", "支票账户"),
        "business_account": ("business account", "企业账户", "对公账户"),
        "wealth": ("wealth management", "理财"),
        "overdraft": ("overdraft", "透支"),
        "cd": ("certificate of deposit", "time deposit", "cd", "定期存款", "定期"),
        "travel_insurance": ("travel insurance", "旅行保险"),
        "car_insurance": ("car insurance", "auto insurance", "汽车保险", "车险"),
    },
    "tier": {
        "platinum": ("platinum", "白金"),
        "gold": ("gold", "金卡"),
        "classic": ("classic", "普卡"),
    },
    "channel": {
        "online": ("online banking", "internet banking", "网上银行", "网银"),
        "mobile": ("mobile banking", "mobile app", "手机银行"),
        "phone": ("call center", "phone banking", "客服中心", "电话银行"),
    },
    "scope": {
        "international": ("international", "overseas", "cross-border", "境外", "跨境", "国际"),
        "domestic": ("domestic", "境内", "国内"),
    },
    "party": {
        "spouse": ("spouse", "wife", "husband", "partner", "配偶", "妻子", "丈夫", "老婆", "老公"),
        "child": ("son", "daughter", "child", "children", "kid", "儿子", "女儿", "孩子"),
        "parent": ("father", "mother", "parent", "parents", "dad", "mom", "父亲", "母亲",
                   "爸爸", "妈妈", "父母"),
        "sibling": ("brother", "sister", "兄弟", "姐妹", "哥哥", "弟弟", "姐姐", "妹妹"),
        "other": ("someone else", "another person", "a friend", "他人", "别人", "朋友"),
    },
}  # fmt: skip
_TERMS_OF = sorted(
    ((name, f"{kind}:{value}") for kind, values in _VOCABULARY.items()
     for value, names in values.items() for name in names),
    key=lambda t: -len(t[0]),
)  # fmt: skip
_VOCAB_RE = re.compile(
    "|".join(
        rf"\b{re.escape(name)}\b".replace(r"\ ", r"\s+") if name.isascii() else re.escape(name)
        for name, _ in _TERMS_OF
    )
)
_VOCAB_FACT = dict(_TERMS_OF)
_CJK_GAP = re.compile(r"(?<=[\u3400-\u9fff])\s+(?=[\u3400-\u9fff])")

_EN_NEG = frozenset(
    {"not", "no", "never", "without", "none", "nor", "cannot", "neither", "nobody", "nothing"}
)
_ZH_NEG = "不没未无别非勿沒無別"

_ZH_NUM_CHARS = "".join(_ZH_DIGITS) + "".join(_ZH_SMALL) + "".join(_ZH_BIG) + "点點"
_EN_UNIT_WORDS = "|".join(sorted(_EN_UNITS, key=len, reverse=True))
_EN_TEN_WORDS = "|".join(_EN_TENS)
_UNIT_ALT = "|".join(re.escape(u) for u in sorted(_TERMS, key=len, reverse=True))

_MARKER = re.compile(r"\[([A-Z][A-Z_]*)([^\]\[]{0,40})\]")
_ACCOUNT = re.compile(r"(?<![\d.])\d(?:[ -]?\d){7,}(?![\d.])")
#: A mask starts where its run of ``*`` / ``x`` starts (the lookbehind): tried from
#: every character of a long run, the search cost the square of the run (20,000
#: asterisks took 7 s).
_MASKED = re.compile(
    r"(?:(?<![*xX•])[*xX•]{2,}|尾号|ending(?:\s+in)?|last\s+four(?:\s+digits)?)[\s:]*"
    r"(\d{3,6})(?!\d)",
    re.IGNORECASE,
)
_DIGITS = re.compile(
    r"(?<![0-9a-z.,])(\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:\s*(k|m|mn|bn|b|thousand|million|billion"
    r"|hundred|[百千万萬亿億])(?![a-z]))?",
    re.IGNORECASE,
)
_ZH_NUMBER = re.compile(f"[{_ZH_NUM_CHARS}]+")
_EN_NUMBER = re.compile(
    rf"\b(?:(?:{_EN_TEN_WORDS})(?:[ -](?:{_EN_UNIT_WORDS}))?|{_EN_UNIT_WORDS}"
    rf"|an?(?=\s+(?:hundred|thousand|million|billion)))(?:\s+(?:hundred|thousand|million|billion))*\b"
)
_PERCENT_AFTER = re.compile(r"^\s*(%|\uff05|percent\b|per cent\b|pct\b)")
_TERM_AFTER = re.compile(rf"^[\s-]*(?:{_UNIT_ALT})(?![a-z])", re.IGNORECASE)
_CUR_ANY = re.compile(
    r"(?:us\$|hk\$|[$¥￥€£円]|(?<![a-z])(?:usd|rmb|cny|eur|gbp|hkd|jpy|yuan|yen|dollars?"
    r"|euros?|pounds?)(?![a-z])|美元|美金|元|块|人民币|欧元|英镑|港币|港元|日元)",
    re.IGNORECASE,
)
_EN_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")

#: A token of letters and digits (dashes inside); an identifier when a letter comes
#: before a digit, which a number with its unit (``20-year``, ``5k``, ``3rd``) never has.
#: Both tests are linear in the token, so a long run of them costs what it is long.
_TOKEN = re.compile(r"(?<![A-Za-z0-9])[A-Za-z0-9]+(?:-[A-Za-z0-9]+)*(?![A-Za-z0-9])")
_LETTER_THEN_DIGIT = re.compile(r"[A-Za-z]-*[0-9]")
#: Words that put what follows them in a transfer's ``from`` or ``to`` role (read in
#: the lower-cased text, with the vocabulary already blanked).
_ROLE = re.compile(
    r"(?P<from>\bfrom\b|\bout\s+of\b|从)|(?P<to>\bto\b|\binto\b|转给|转入|转到|给|到|向)"
)
#: What may stand between a role word and its party: a few words (``from the account
#: of my wife``), three Chinese characters (``从我妻子``), no number and no clause's
#: punctuation (full-width commas and the like are ASCII after NFKC; 。 and 、 are not).
_ROLE_GAP = re.compile(r"[^0-9.,;:!?()\u3002\u3001]{0,40}")
_CJK = re.compile(r"[\u3400-\u9fff]")
#: A capitalised name (or a brand in capitals, ``JD``) of up to three words after a
#: role word; the role word in any case, the name's first letter in upper case.
_NAME_EN = re.compile(
    r"\b(?i:(?P<role>to|for|from|pay|paid|paying|payee|into|named|called))\s+"
    r"(?P<name>[A-Z][A-Za-z&.-]*(?:'[A-Za-z]+)?(?:\s+[A-Z][A-Za-z&.-]*(?:'[A-Za-z]+)?){0,2})"
)
_NAME_STOP = frozenset(
    {"my", "your", "our", "his", "her", "their", "its", "the", "a", "an", "this", "that",
     "these", "those", "me", "us", "him", "them", "it", "i", "you", "we", "they", "he",
     "she", "what", "which", "who", "whom", "whose", "how", "when", "where", "why", "all",
     "any", "some", "each", "every", "another", "and", "or", "do", "does", "can", "is"}
)  # fmt: skip
_NAME_ZH = re.compile(r"(?P<role>转给|付给|汇给|给|向|从)(?P<name>[\u3400-\u9fff]{2,4})")
#: A Chinese name ends where a verb or particle starts (``给张伟转``, ``向李娜付款``),
#: and is not a pronoun (``给我``, ``从他``).
_ZH_NAME_END = re.compile(
    r"[转汇付打发的账元块钱吗呢吧了还买退开办申和与及或在是把有没不都也就要想能可]"
)
_ZH_PRONOUN = "我你他她它您咱自予"


def facts(text: str) -> tuple[str, ...]:
    """The canonical list of facts in ``text`` (see the module docstring)."""
    s = unicodedata.normalize("NFKC", text).replace("\u2019", "'")
    s = _CJK_GAP.sub("", s)  # 二 十 年 is 二十年: Chinese is not written with spaces
    out: list[str] = []
    # What a transfer's direction may apply to, by where it starts.
    spans: list[tuple[int, str]] = []
    # Redaction markers, account numbers and identifiers first, blanked so their digits
    # are not read again as amounts.
    s = _MARKER.sub(lambda m: _marker(m, out, spans), s)
    s = _MASKED.sub(lambda m: _blank(m, out, "acct:" + m.group(1), spans), s)
    s = _ACCOUNT.sub(lambda m: _blank(m, out, "acct:" + re.sub(r"\D", "", m.group(0)), spans), s)
    s = _TOKEN.sub(lambda m: _identifier(m, out, spans), s)
    low = s.casefold()
    low = _VOCAB_RE.sub(
        lambda m: _blank(m, out, _VOCAB_FACT[" ".join(m.group(0).split())], spans), low
    )
    _names(s, low, out)
    taken = [False] * len(low)
    for m in _DIGITS.finditer(low):
        value = _decimal(m.group(1).replace(",", ""))
        scale = (m.group(2) or "").lower()
        if value is not None:
            if scale:
                value *= _SCALES[scale]
            _number(low, m.start(), m.end(), value, out, taken)
    for m in _ZH_NUMBER.finditer(low):
        if any(taken[m.start() : m.end()]):
            continue
        value = _zh_value(m.group(0))
        if value is not None:
            _number(low, m.start(), m.end(), value, out, taken)
    for m in _EN_NUMBER.finditer(low):
        if any(taken[m.start() : m.end()]):
            continue
        value = _en_value(m.group(0))
        if value is not None:
            _number(low, m.start(), m.end(), value, out, taken)
    for m in re.finditer(r"\b(?:a|an|one)\s+(year|month|week|day)\b", low):
        if not any(taken[m.start() : m.end()]):
            out.append(f"term:1{_TERMS[m.group(1)]}")
    for m in _CUR_ANY.finditer(low):
        out.append("cur:" + _CURRENCIES[m.group(0).casefold()])
    for phrase, fact in _DATES.items():
        if phrase.isascii():
            pattern = rf"\b{phrase}\b".replace(" ", r"\s+")
            out += ["date:" + fact] * len(re.findall(pattern, low))
        else:
            out += ["date:" + fact] * low.count(phrase)
    out += ["neg"] * _negations(low)
    _roles(low, spans, out)
    return tuple(sorted(out))


def _blank(
    m: re.Match[str], out: list[str], fact: str, spans: list[tuple[int, str]] | None = None
) -> str:
    out.append(fact)
    if spans is not None:
        spans.append((m.start(), fact))
    return " " * len(m.group(0))


def _marker(m: re.Match[str], out: list[str], spans: list[tuple[int, str]]) -> str:
    digits = re.sub(r"\D", "", m.group(2))
    fact = f"mark:{m.group(1).lower()}" + (f":{digits}" if digits else "")
    return _blank(m, out, fact, spans)


def _identifier(m: re.Match[str], out: list[str], spans: list[tuple[int, str]]) -> str:
    """An identifier (``REF-AB12``) as one ``id`` fact, blanked; any other token as is."""
    token = m.group(0)
    if _LETTER_THEN_DIGIT.search(token) is None:
        return token
    return _blank(m, out, "id:" + token.replace("-", "").casefold(), spans)


def _names(s: str, low: str, out: list[str]) -> None:
    """The parties and merchants named after a role word (``pay Zhang Wei``, ``给李娜``).

    English names are told by their capital, so only in text that has lower-case
    letters too (in ``TO ZHANG WEI`` or ``to zhang wei`` every word looks alike, and the
    upper- and lower-case texts must read the same); a word the vocabulary, the
    currencies, the dates or the numbers already read is not a name."""
    aligned = len(s) == len(low)
    if aligned and any(c.islower() for c in s):
        for m in _NAME_EN.finditer(s):
            words: list[str] = []
            for i, word in enumerate(m.group("name").split()):
                word = word.rstrip(".-&")
                key = word.casefold().removesuffix("'s")
                if (
                    (i == 0 and key in _NAME_STOP)
                    or key in _DATES
                    or key in _EN_UNITS
                    or key in _EN_TENS
                    or _CUR_ANY.fullmatch(key)
                ):
                    break
                words.append(key)
            # a word the vocabulary took is blank in ``low``
            if words and not low[m.start("name")].isspace():
                role = "from" if m.group("role").casefold() == "from" else "to"
                out.append(f"name:{role}:{' '.join(words)}")
    for m in _NAME_ZH.finditer(low):
        name = _ZH_NAME_END.split(m.group("name"), maxsplit=1)[0]
        if len(name) >= 2 and name[0] not in _ZH_PRONOUN:
            out.append(f"name:{'from' if m.group('role') == '从' else 'to'}:{name}")


def _roles(low: str, spans: list[tuple[int, str]], out: list[str]) -> None:
    """``from:FACT`` / ``to:FACT`` for each fact shortly after a role word.

    The nearest role word before the fact decides (``from my wife's account to my
    son's``: wife after ``from``, son after ``to``), if what stands between them is a
    few words or three Chinese characters at most, with no clause's punctuation. One
    pass over the text and a bisection a fact: bounded work."""
    if not spans:
        return
    marks = [(m.end(), "from" if m.group("from") else "to") for m in _ROLE.finditer(low)]
    ends = [end for end, _ in marks]
    for start, fact in spans:
        i = bisect_right(ends, start) - 1
        if i < 0:
            continue
        end, role = marks[i]
        gap = low[end:start]
        if _ROLE_GAP.fullmatch(gap) and len(gap.split()) <= 4 and len(_CJK.findall(gap)) <= 3:
            out.append(f"{role}:{fact}")


def _number(
    low: str, start: int, end: int, value: Decimal, out: list[str], taken: list[bool]
) -> None:
    for i in range(start, end):
        taken[i] = True
    rest = low[end:]
    n = _canon(value)
    if _PERCENT_AFTER.match(rest) or low[max(0, start - 3) : start] == "百分之":
        out.append(f"pct:{n}")
        return
    unit = _TERM_AFTER.match(rest)
    if unit is not None:
        word = unit.group(0).strip(" -").casefold()
        kind = _TERMS[word]
        if kind == "y" and word == "年" and 1900 <= value <= 2200:
            out.append(f"date:year:{n}")  # 2026年: a year, not a term
        else:
            out.append(f"term:{n}{kind}")
        for i in range(end, end + unit.end()):
            taken[i] = True
        return
    out.append(f"num:{n}")


def _canon(value: Decimal) -> str:
    """One spelling of a value; by ``format``, since ``str(int(...))`` refuses an integer
    of more than 4,300 digits (a question of 5,000 ones raised ValueError)."""
    if value == value.to_integral_value():
        return format(value.to_integral_value(), "f")
    return format(value.normalize(), "f")


def _decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def _en_value(phrase: str) -> Decimal | None:
    total = Decimal(0)
    current = Decimal(0)
    for word in re.split(r"[ -]+", phrase):
        if word in ("a", "an"):
            current = Decimal(1)
        elif word in _EN_UNITS:
            current += _EN_UNITS[word]
        elif word in _EN_TENS:
            current += _EN_TENS[word]
        elif word == "hundred":
            current = (current or Decimal(1)) * 100
        elif word in _SCALES:
            total += (current or Decimal(1)) * _SCALES[word]
            current = Decimal(0)
    return total + current


def _zh_value(text: str) -> Decimal | None:
    """A Chinese numeral (``二十``, ``两万五千``, ``三点五``, ``一二三``); None for
    one that is only a unit character (``千`` alone is not a number)."""
    if not any(c in _ZH_DIGITS for c in text) and text[0] not in "十拾":
        return None
    if "点" in text or "點" in text:
        whole, _, frac = text.replace("點", "点").partition("点")
        head = _zh_value(whole) if whole else Decimal(0)
        digits = "".join(str(_ZH_DIGITS[c]) for c in frac if c in _ZH_DIGITS)
        if head is None:
            return None
        return head + (Decimal("0." + digits) if digits else Decimal(0))
    if all(c in _ZH_DIGITS for c in text) and len(text) > 1:
        return Decimal("".join(str(_ZH_DIGITS[c]) for c in text))  # read digit by digit
    total = Decimal(0)
    section = Decimal(0)
    digit = Decimal(0)
    for c in text:
        if c in _ZH_DIGITS:
            digit = Decimal(_ZH_DIGITS[c])
        elif c in _ZH_SMALL:
            section += (digit or 1) * _ZH_SMALL[c]
            digit = Decimal(0)
        elif c in _ZH_BIG:
            total = (total + section + digit) * _ZH_BIG[c]
            section = digit = Decimal(0)
    return total + section + digit


def _negations(low: str) -> int:
    count = 0
    for m in _EN_WORD.finditer(low):
        word = m.group(0)
        if word in _EN_NEG or word.endswith("n't"):
            count += 1
    i = 0
    while i < len(low):
        # 能不能, 有没有, 可不可以: a question (A-not-A), not a negation
        if low[i] in _ZH_NEG and 0 < i < len(low) - 1 and low[i - 1] == low[i + 1]:
            i += 2
        elif low[i] in _ZH_NEG:
            count += 1
            # 没有 / 沒有 is one negation
            i += 2 if low[i] in "没沒" and low[i + 1 : i + 2] == "有" else 1
        else:
            i += 1
    return count
