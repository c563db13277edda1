"""SentenceChunker: where a streamed reply is cut into speakable pieces."""

from __future__ import annotations

import pytest

from ivr.callio.sentences import SentenceChunker, clean_for_speech, first_piece
from ivr.testing.openai_server import split_tokens

CASES: list[tuple[str, list[str]]] = [
    ("Hello there. How are you?", ["Hello there.", "How are you?"]),
    ("Your balance is $123.45. Anything else?", ["Your balance is $123.45.", "Anything else?"]),
    ("Pi is about 3.14159 and e is 2.718.", ["Pi is about 3.14159 and e is 2.718."]),
    ("Mr. Smith will call you. Dr. Jones too.", ["Mr. Smith will call you.", "Dr. Jones too."]),
    ("Bring ID, e.g. a passport. Thanks.", ["Bring ID, e.g. a passport.", "Thanks."]),
    ("She moved to the U.S. last year. Nice.", ["She moved to the U.S. last year.", "Nice."]),
    ("The office opens at 9 a.m. tomorrow.", ["The office opens at 9 a.m. tomorrow."]),
    ("Ask for John F. Kennedy. He knows.", ["Ask for John F. Kennedy.", "He knows."]),
    ("Well... let me think. Okay!", ["Well... let me think.", "Okay!"]),
    ("An ellipsis… still going. Done.", ["An ellipsis… still going.", "Done."]),
    ("What?! Really? Yes.", ["What?!", "Really?", "Yes."]),
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("Time is 9:30 now, okay? Sure.", ["Time is 9:30 now, okay?", "Sure."]),
    (
        "We have 1,000,000 customers, and counting. Wow.",
        ["We have 1,000,000 customers,", "and counting.", "Wow."],
    ),
    (
        "Yes. I can help with that, but first I need your account number, please.",
        ["Yes.", "I can help with that, but first I need your account number, please."],
    ),
    (
        "Sure! Here are your options:\n1. Check balance\n2. Talk to an agent",
        ["Sure!", "Here are your options:", "1. Check balance", "2. Talk to an agent"],
    ),
    (
        "**Sure!** Here is the *summary*.\n- item `one`\n* item two",
        ["Sure!", "Here is the summary.", "item one", "item two"],
    ),
    ("# Account summary\nYour balance is `$5`.", ["Account summary", "Your balance is $5."]),
    ("See [our website](https://example.com/x) for more.", ["See our website for more."]),
    ("---\n***\nHi.", ["Hi."]),
    ("_Really_ sure about account_id? Yes.", ["Really sure about account_id?", "Yes."]),
    ("I have 3. You have 4.", ["I have 3.", "You have 4."]),
    ("", []),
]


def chunk(text: str, pieces: list[str], chunker: SentenceChunker | None = None) -> list[str]:
    chunker = chunker or SentenceChunker()
    out: list[str] = []
    for piece in pieces:
        out += chunker.push(piece)
    return out + chunker.flush()


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_a_reply_fed_whole_is_cut_where_expected(text, expected):
    assert chunk(text, [text]) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_the_cut_does_not_depend_on_how_the_deltas_fall(text, expected):
    splits = {
        "chars": list(text),
        "tokens": split_tokens(text),
        "pairs": [text[i : i + 2] for i in range(0, len(text), 2)],
        "sevens": [text[i : i + 7] for i in range(0, len(text), 7)],
    }
    for name, pieces in splits.items():
        assert chunk(text, pieces) == expected, name


def test_a_finished_first_clause_is_returned_before_the_sentence_ends():
    chunker = SentenceChunker()
    assert chunker.push("Let me look that up for you,") == []  # undecided: "1,000" or ", "?
    assert chunker.push(" one") == ["Let me look that up for you,"]
    assert chunker.push(" moment please.") == []
    assert chunker.flush() == ["one moment please."]


def test_a_sentence_is_returned_as_soon_as_the_next_character_arrives():
    chunker = SentenceChunker()
    assert chunker.push("Your total is $5.") == []
    assert chunker.push("50") == []
    assert chunker.push(". Thanks") == ["Your total is $5.50."]


def test_later_clauses_wait_for_the_full_sentence():
    long_sentence = "After that, " + "we will check every account you have with us " * 3 + "today."
    assert len(long_sentence) > 120  # its only comma comes early, so no clause cut
    out = chunk("", ["Okay. ", long_sentence, " Bye."])
    assert out == ["Okay.", long_sentence, "Bye."]


def test_a_long_sentence_with_commas_is_cut_at_a_clause_past_the_limit():
    words = ", ".join(f"item number {n}" for n in range(20)) + "."
    out = chunk("", ["Sure. ", words])
    assert out[0] == "Sure."
    assert len(out) > 2
    assert all(piece.endswith((",", ".")) for piece in out)
    assert all(len(piece) <= 300 for piece in out)
    assert " ".join(out[1:]) == words


def test_run_on_text_without_punctuation_is_cut_at_spaces_below_the_maximum():
    text = " ".join(f"word{n}" for n in range(120))
    out = chunk(text, list(text))
    assert len(out) > 1
    assert all(len(piece) <= 300 for piece in out)
    assert " ".join(out) == text


def test_flush_resets_so_the_next_reply_may_start_with_a_short_clause_again():
    chunker = SentenceChunker()
    assert chunk("", ["First reply is here. "], chunker) == ["First reply is here."]
    assert chunker.push("Second reply starts here, ") == ["Second reply starts here,"]


@pytest.mark.parametrize(
    ("raw", "spoken"),
    [
        ("**bold** and __strong__", "bold and strong"),
        ("`code`  spaced\n\nout", "code spaced out"),
        ("## Heading", "Heading"),
        ("> quoted", "quoted"),
        ("~~gone~~ kept", "gone kept"),
        ("snake_case_name stays", "snake_case_name stays"),
        ("press # to repeat", "press # to repeat"),
    ],
)
def test_markdown_that_tts_would_read_out_is_removed(raw, spoken):
    assert clean_for_speech(raw) == spoken


def test_inconsistent_limits_are_rejected_with_the_values():
    with pytest.raises(ValueError, match="first_clause_chars <= clause_chars"):
        SentenceChunker(first_clause_chars=50, clause_chars=40)


# -- a voice that renders a piece whole: the first piece may end after a few words ----------


def test_the_first_piece_ends_after_its_words_and_the_rest_of_the_sentence_goes_whole():
    chunker = SentenceChunker(first_words=4)
    text = "The shop is located in the 42 Harbor Street, next to the ferry terminal. Bye now."
    pieces = [p for token in split_tokens(text) for p in chunker.push(token)] + chunker.flush()
    assert pieces == [
        "The shop is located",
        "in the 42 Harbor Street, next to the ferry terminal.",
        "Bye now.",
    ]


def test_a_word_cut_waits_for_the_space_that_ends_the_word():
    chunker = SentenceChunker(first_words=4)
    assert chunker.push("The shop is locat") == []
    assert chunker.push("ed") == []  # "located" may still go on ("locatedness")
    assert chunker.push(" in") == ["The shop is located"]


@pytest.mark.parametrize(
    ("text", "first"),
    [
        ("Great, a mountain bike. Bring it in.", "Great, a mountain bike."),  # sentence first
        ("Yes. We open at 9:30 on weekdays.", "Yes."),
        ("Certainly, we are open until six tonight.", "Certainly, we are open"),
        ("We close at 5.30 pm on Saturdays.", "We close at 5.30"),  # never inside a number
        ("  **Sure**, I can check. One moment.", "Sure, I can check."),
    ],
)
def test_a_clause_or_sentence_end_before_the_words_still_ends_the_first_piece(text, first):
    chunker = SentenceChunker(first_words=4)
    pieces = [p for token in split_tokens(text) for p in chunker.push(token)] + chunker.flush()
    assert pieces[0] == first
    assert " ".join(pieces) == clean_for_speech(text)


def test_first_piece_is_what_a_reply_of_that_text_asks_the_voice_for_first():
    text = "Great, a mountain bike. Bring it in any time we're open; it takes two days."
    assert first_piece(text) == "Great, a mountain bike."
    assert first_piece("Thanks for calling Harbor Bikes to book a repair.", first_words=4) == (
        "Thanks for calling Harbor"
    )
    assert first_piece("The shop is located", first_words=4) == "The shop is located"
    assert first_piece("  ** ") == ""


def test_first_words_must_be_positive():
    with pytest.raises(ValueError, match="first_words must be >= 1"):
        SentenceChunker(first_words=0)
