"""What the data engine asks about: categories, each with openers the target completes.

Magpie-style prompts: the chat template is opened at a user turn and the *target* writes the
user's message. A 135M model left entirely free writes the same few requests over and over, so
each category steers it with an opener, the first words of the user message (a topic, a
language pair, a passage and a lead-in), and the target continues from there. The category
list covers what a general assistant is asked (open chat and writing, roleplay, reasoning,
coding, math word problems, translation between 12 language pairs, summarization and
extraction over a passage, question answering, answers from a provided context) and
multi-turn follow-ups (``FOLLOW_UPS``).

Placeholders in an opener: ``{topic}`` (one of the category's topics, or the shared
``TOPICS``), ``{passage}`` (a passage of installed text, ``selfspec.train.datagen.passages``),
``{source}`` / ``{target}`` (a language pair).
"""

from __future__ import annotations

from dataclasses import dataclass

TOPICS = (
    "the ocean",
    "a small bakery",
    "climate change",
    "the history of Rome",
    "space travel",
    "a rainy afternoon",
    "friendship",
    "learning a new language",
    "electric cars",
    "volcanoes",
    "a job interview",
    "the human heart",
    "honeybees",
    "a mountain village",
    "public libraries",
    "renewable energy",
    "a lost dog",
    "the stock market",
    "ancient Egypt",
    "healthy breakfast",
    "photosynthesis",
    "a chess tournament",
    "city parks",
    "the moon landing",
    "coffee",
    "time management",
    "a birthday party",
    "recycling",
    "the printing press",
    "deserts",
    "music festivals",
    "a train journey",
    "vaccines",
    "social media",
    "gardening",
    "black holes",
    "the Olympic games",
    "a haunted house",
    "saving money",
    "penguins",
    "remote work",
    "the water cycle",
    "a first day at school",
    "bridges",
    "chocolate",
    "earthquakes",
    "a family dinner",
    "robots",
    "the Amazon rainforest",
    "board games",
    "sleep",
    "pirates",
    "a museum visit",
    "the internet",
    "volunteering",
    "dinosaurs",
    "a football match",
    "tea ceremonies",
    "glaciers",
    "a road trip",
    "artificial intelligence",
    "the Silk Road",
    "composting",
    "a science fair",
    "bicycles",
    "the immune system",
    "a snowy morning",
    "cooking pasta",
    "lighthouses",
    "the French Revolution",
    "nutrition",
    "a wedding",
    "airplanes",
    "coral reefs",
    "meditation",
    "a detective",
    "solar panels",
    "elephants",
)

LANGUAGE_PAIRS = (
    ("English", "French"),
    ("English", "Spanish"),
    ("English", "German"),
    ("French", "English"),
    ("Spanish", "English"),
    ("German", "English"),
    ("English", "Italian"),
    ("English", "Portuguese"),
    ("Italian", "English"),
    ("English", "Dutch"),
    ("Portuguese", "English"),
    ("English", "Chinese"),
)


@dataclass(frozen=True)
class Category:
    """One kind of request. ``share`` is its fraction of the conversations (shares are
    normalised); ``openers`` are formatted with the placeholders above and completed by the
    target; ``topics`` replaces ``TOPICS`` where given."""

    name: str
    share: float
    openers: tuple[str, ...]
    topics: tuple[str, ...] = TOPICS
    passage: bool = False
    """The opener holds a ``{passage}``."""
    languages: bool = False
    """The opener holds ``{source}`` and ``{target}``."""

    def __post_init__(self) -> None:
        if self.share <= 0 or not self.openers:
            raise ValueError(f"category {self.name!r} needs a share > 0 and at least one opener")


CATEGORIES = (
    Category(
        "chat",
        0.12,
        (
            "What do you think about {topic}? ",
            "Can you tell me something interesting about {topic}",
            "I have a question about {topic}: ",
            "Give me some advice on ",
            "How can I ",
            "Why do people ",
            "What is the best way to ",
            "Explain to me ",
        ),
    ),
    Category(
        "writing",
        0.11,
        (
            "Write a short story about {topic}",
            "Write a poem about {topic}",
            "Write an email to ",
            "Write a blog post about {topic}",
            "Write a product description for ",
            "Draft a short speech about {topic}",
            "Write a letter to ",
            "Write a paragraph describing {topic}",
        ),
    ),
    Category(
        "roleplay",
        0.07,
        (
            "Pretend you are ",
            "You are a tour guide. ",
            "Act as a teacher and ",
            "Imagine you are a character in a story about {topic}. ",
            "Play the role of ",
            "You are a chef. ",
        ),
    ),
    Category(
        "reasoning",
        0.08,
        (
            "If ",
            "Which is heavier, ",
            "A man has ",
            "What would happen if ",
            "Compare {topic} and ",
            "What are the pros and cons of ",
            "Is it true that ",
            "Solve this riddle: ",
        ),
    ),
    Category(
        "coding",
        0.10,
        (
            "Write a Python function that ",
            "How do I ",
            "Explain what this code does: ",
            "Write a JavaScript function to ",
            "What is the difference between a list and ",
            "Fix the bug in this code: ",
            "Write a SQL query that ",
            "Write a Python class for ",
            "How do I sort ",
            "Write a shell command to ",
        ),
        topics=("files", "strings", "lists", "dates", "numbers", "web pages", "JSON", "users"),
    ),
    Category(
        "math",
        0.10,
        (
            "A store sells ",
            "Tom has ",
            "A train travels ",
            "Sarah buys ",
            "What is ",
            "If a rectangle has ",
            "A class has ",
            "Solve for x: ",
            "John earns ",
            "A recipe needs ",
        ),
    ),
    Category(
        "translation",
        0.12,
        (
            'Translate from {source} to {target}: "',
            'Translate this {source} sentence into {target}: "',
            'How do you say this in {target}? "',
            "Please translate into {target}:\n\n",
        ),
        languages=True,
    ),
    Category(
        "summarization",
        0.09,
        (
            "{passage}\n\nSummarize the text above ",
            "Summarize this:\n\n{passage}\n\n",
            "{passage}\n\nGive me a short summary ",
            "{passage}\n\nWhat is the main point ",
            "{passage}\n\nList the key facts ",
            "{passage}\n\nExtract ",
        ),
        passage=True,
    ),
    Category(
        "qa",
        0.11,
        (
            "What is {topic}?",
            "Who ",
            "When did ",
            "Where is ",
            "How does ",
            "What are ",
            "Why is ",
            "How many ",
        ),
    ),
    Category(
        "rag",
        0.10,
        (
            "Context:\n{passage}\n\nQuestion: ",
            "Use the text below to answer.\n\n{passage}\n\nQuestion: ",
            "{passage}\n\nAccording to the passage, ",
            "Read this:\n\n{passage}\n\nBased on it, ",
        ),
        passage=True,
    ),
)

FOLLOW_UPS = (
    "Can you ",
    "Thanks! Now ",
    "Why ",
    "Make it ",
    "What about ",
    "Could you explain ",
    "Great. ",
    "Can you give me an example ",
    "Please ",
    "And ",
)
"""Openers of the second user turn of a multi-turn conversation (any category)."""


def by_name() -> dict[str, Category]:
    return {category.name: category for category in CATEGORIES}
