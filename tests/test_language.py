from pipeline.steps.language import LanguageConfig, LanguageFilter, normalise_for_lid

ENGLISH = (
    "The committee met on Tuesday to discuss the new budget for the public library, and most members "
    "agreed that the opening hours should be longer during the winter months."
)
FRENCH = (
    "Le conseil municipal s'est réuni mardi pour discuter du nouveau budget de la bibliothèque, et la "
    "plupart des membres ont convenu que les horaires d'ouverture devraient être plus longs en hiver."
)
GERMAN = (
    "Der Gemeinderat traf sich am Dienstag, um über den neuen Haushalt der Stadtbibliothek zu sprechen, "
    "und die meisten Mitglieder waren sich einig, dass die Öffnungszeiten im Winter länger sein sollten."
)
CHINESE = "委员会星期二开会讨论了公共图书馆的新预算，大多数成员同意冬季的开放时间应该更长。"


def docs_of(*texts):
    return [{"text": t} for t in texts]


def test_default_keeps_english_and_drops_other_languages_with_the_language_as_reason():
    docs = LanguageFilter()(docs_of(ENGLISH, FRENCH, GERMAN, CHINESE))
    assert [d["language"] for d in docs] == ["en", "fr", "de", "zh"]
    assert [d.get("reason") for d in docs] == [None, "language:fr", "language:de", "language:zh"]
    assert all(d["stage"] == "language" for d in docs[1:])
    assert docs[0]["language_score"] > 0.65


def test_configured_languages_and_threshold():
    docs = LanguageFilter(LanguageConfig(languages=["fr", "de"]))(docs_of(ENGLISH, FRENCH, GERMAN))
    assert [d.get("reason") for d in docs] == ["language:en", None, None]
    strict = LanguageFilter(LanguageConfig(min_score=1.0))(docs_of(ENGLISH))
    assert strict[0]["reason"] == "low_language_score"


def test_newlines_do_not_change_the_prediction():
    assert normalise_for_lid("one\ntwo\r\n three\t") == "one two three"
    split = ENGLISH.replace(", ", ",\n")
    a, b = LanguageFilter()(docs_of(ENGLISH, split))
    assert a["language"] == b["language"] == "en"


def test_already_dropped_documents_are_left_alone():
    docs = [{"text": FRENCH, "stage": "extract", "reason": "truncated_record"}]
    LanguageFilter()(docs)
    assert docs[0]["reason"] == "truncated_record" and "language" not in docs[0]


def test_language_is_read_from_a_bounded_prefix():
    page = ENGLISH + "\n" + (FRENCH + "\n") * 40  # English head, long French body
    prefix = LanguageFilter(LanguageConfig(max_chars=len(ENGLISH)))(docs_of(page))[0]
    whole = LanguageFilter(LanguageConfig(max_chars=None, languages=["fr"]))(docs_of(page))[0]
    assert prefix["language"] == "en" and prefix.get("reason") is None
    assert whole["language"] == "fr" and whole.get("reason") is None
    assert normalise_for_lid("a  b\n\nc " * 1000, max_chars=5) == "a b c"
