"""RAG-shaped chat prompts over invented facts: a model can only answer them from the documents it is given.

Every document describes one fictional organisation (an invented name, town, founder, year and head count); the
question asks one fact of one document and the known answer is checked in the model's reply. Names are built from
random syllables, so no pretrained model has seen them, and every number is drawn at random.

``FactPrompt.messages(order)`` is the chat conversation with each document in ``<pic>`` tags; the documents were
cached in index order (``order`` is never the identity, so every reused document moves).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

SYSTEM = "You are a helpful assistant. Answer the question using only the documents. Reply with a short answer."
_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "kl", "l", "m", "n", "p", "qu", "r", "s", "st", "t", "tr",
           "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "", "n", "r", "l", "s")
_KINDS = ("research institute", "shipping company", "botanical society", "observatory", "weaving guild",
          "clock factory", "mountain rescue service", "music academy")
_STAFF = ("researchers", "sailors", "gardeners", "astronomers", "weavers", "clockmakers", "rescuers", "teachers")
QUESTIONS = {
    "founder": "Who founded the {name}?",
    "year": "In which year was the {name} founded?",
    "town": "In which town is the {name} based?",
    "staff": "How many {staff} work at the {name}?",
}


# background sentences that lengthen a document without stating another founder, year, town or head count
_DETAILS = (
    "Its main building has {colour} walls and a {material} roof that was repaired after a storm.",
    "Visitors often mention the {adjective} garden behind the entrance and the {adjective2} smell of the old library.",
    "Every member receives a {colour} badge on the first day and learns the house rules from an older colleague.",
    "The staff meet in the {room} each week to plan the next season and to discuss letters from the public.",
    "A small museum on the ground floor shows {objects} collected over many decades.",
    "The {kind_word} is known in the region for its careful records and its {adjective} annual celebration.",
    "Several paintings of the surrounding hills hang in the {room}, most of them by local artists.",
    "In winter the {material} stove in the {room} is kept burning from early morning until late at night.",
    "Its newsletter describes recent work, upcoming events and the history of the {objects} in its care.",
    "Young volunteers help with the {objects} during the summer and stay in a {colour} guest house nearby.",
    "The road to the entrance is lined with {adjective} trees that were planted by the first members.",
    "Its archive keeps old maps, letters and photographs, and it is open to researchers on request.",
)
_FILL = {"colour": ("white", "grey", "yellow", "green", "blue", "red"),
         "material": ("slate", "copper", "tile", "iron", "stone", "wooden"),
         "adjective": ("quiet", "famous", "large", "beautiful", "old", "busy"),
         "adjective2": ("faint", "pleasant", "strong", "familiar", "dusty", "sweet"),
         "room": ("great hall", "reading room", "east wing", "meeting room", "attic", "courtyard"),
         "objects": ("instruments", "tools", "old books", "models", "photographs", "maps"),
         "kind_word": ("place", "institution", "house", "organisation")}


MAX_DETAIL_SENTENCES = len(_DETAILS)  # each document draws them without repeats


def _details(rng: random.Random, count: int) -> tuple[str, ...]:
    if not 0 <= count <= MAX_DETAIL_SENTENCES:
        raise ValueError(f"detail sentences must be 0 to {MAX_DETAIL_SENTENCES}, got {count}")
    chosen = rng.sample(range(len(_DETAILS)), count)
    return tuple(_DETAILS[i].format(**{key: rng.choice(values) for key, values in _FILL.items()}) for i in chosen)


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(syllables)).capitalize()


@dataclass(frozen=True)
class FictionalOrganisation:
    name: str
    kind: str
    staff_noun: str
    town: str
    founder: str
    year: int
    staff: int
    details: tuple[str, ...] = ()  # background sentences after the facts

    @classmethod
    def random(cls, rng: random.Random) -> FictionalOrganisation:
        kind = rng.randrange(len(_KINDS))
        return cls(f"{_word(rng, 2)} {_KINDS[kind].title()}", _KINDS[kind], _STAFF[kind], _word(rng, 2),
                   f"{_word(rng, 2)} {_word(rng, 2)}", rng.randrange(1650, 1990), rng.randrange(12, 980))

    def document(self) -> str:
        # every fact in the first sentence: a small model that answers by restating it still states the answer
        return (f"The {self.name} was founded by {self.founder} in {self.year} in the town of {self.town}, "
                f"where {self.staff} {self.staff_noun} work today. It is a {self.kind} with a long history, and "
                f"its annual report is published every spring." + "".join(f" {d}" for d in self.details))

    def answer(self, fact: str) -> str:
        return {"founder": self.founder, "year": str(self.year), "town": self.town, "staff": str(self.staff)}[fact]


@dataclass(frozen=True)
class FactPrompt:
    organisations: tuple[FictionalOrganisation, ...]  # the documents, in the order they were cached
    order: tuple[int, ...]  # the order the request lists them in
    asked: int  # which organisation the question is about
    fact: str  # which fact (a key of QUESTIONS)

    @classmethod
    def random(cls, seed: int, min_docs: int = 4, max_docs: int = 6, detail_sentences: int = 0) -> FactPrompt:
        """``detail_sentences`` background sentences per document lengthen it (12: ~270 tokens, RAGPulse's)."""
        rng = random.Random(seed)
        count = rng.randint(min_docs, max_docs)
        organisations = tuple(FictionalOrganisation.random(rng) for _ in range(count))
        if detail_sentences:  # drawn apart, so a seed states the same facts and asks the same question either way
            details = random.Random(f"details-{seed}")
            organisations = tuple(dataclasses.replace(o, details=_details(details, detail_sentences))
                                  for o in organisations)
        order = list(range(count))
        while order == sorted(order):
            rng.shuffle(order)
        return cls(organisations, tuple(order), rng.randrange(count), rng.choice(sorted(QUESTIONS)))

    @property
    def documents(self) -> list[str]:
        return [organisation.document() for organisation in self.organisations]

    @property
    def question(self) -> str:
        target = self.organisations[self.asked]
        return QUESTIONS[self.fact].format(name=target.name, staff=target.staff_noun)

    @property
    def answer(self) -> str:
        return self.organisations[self.asked].answer(self.fact)

    def messages(self, order: tuple[int, ...] | None = None) -> list[dict]:
        """The chat conversation: system prompt, then one user turn with the documents (``<pic>``) and question."""
        docs = "".join(f"<pic>Document: {self.documents[i]}\n</pic>" for i in (order or self.order))
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{docs}Question: {self.question}"}]

    def is_correct(self, reply: str) -> bool:
        return self.answer.lower() in reply.lower()
