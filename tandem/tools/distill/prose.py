"""Templated openings of everyday English prose, for the target's own generations to be distilled on.

The shipped head's data is mostly code (stdlib sources and function openings). These openings ask the
target for stories, letters, explanations, instructions, histories and reviews instead. They are
written for this module, never taken from the bench prompt set, and every slot draws from the even
half of its word list for training and from the odd half for held-out prompts, as
``corpus.generation_prompt`` does.
"""

from __future__ import annotations

import random

from tandem.tools.distill.corpus import _pick

_PEOPLE = ["Amara", "Bruno", "Clara", "Dmitri", "Elena", "Felix", "Greta", "Hugo", "Irene", "Jamal", "Keiko",
           "Luca", "Marta", "Nikhil", "Olga", "Pablo", "Rania", "Samuel", "Tessa", "Umar", "Vera", "William"]
_PLACES = ["a mountain town", "the old harbour", "a crowded market", "a quiet library", "the northern coast",
           "a farm outside the city", "a small bakery", "the train station", "an island village", "a river valley",
           "a university campus", "the edge of the forest", "a busy hospital", "a fishing boat", "a museum",
           "a desert road"]
_SUBJECTS = ["the bicycle", "volunteering", "public libraries", "sleep", "tea", "the moon landing", "rivers",
             "learning a language", "bread", "cities at night", "electric cars", "chess", "the postal service",
             "friendship", "gardening", "the printing of newspapers", "clocks", "rain", "teamwork", "maps",
             "vaccines", "the internet", "forests", "music lessons", "recycling", "the Roman roads", "bees",
             "saving money", "public speaking", "wind power", "earthquakes", "coffee"]
_JOBS = ["nurse", "carpenter", "teacher", "pilot", "chef", "librarian", "engineer", "gardener", "journalist",
         "firefighter", "accountant", "photographer", "designer", "mechanic", "pharmacist", "translator"]
_THINGS = ["a pair of walking boots", "a coffee grinder", "a used bicycle", "a desk lamp", "a travel backpack",
           "a kitchen knife", "a laptop stand", "a wool blanket", "a rain jacket", "a water bottle",
           "a board game", "a tent"]
_DISHES = ["lentil soup", "banana bread", "a vegetable curry", "pancakes", "a tomato sauce", "roast potatoes",
           "a fruit salad", "rice pudding", "a simple pizza dough", "garlic noodles", "a bean chili", "scones"]
_TIMES = ["Early one morning", "On the last day of winter", "Late that night", "Every Sunday", "Years later",
          "Just before the storm", "At the end of the war", "When the school bell rang", "That autumn",
          "On her first day", "Long before the road was built", "As the sun came up"]


def prose_prompt(rng: random.Random, heldout: bool) -> str:
    """One opening in one of the everyday prose genres, its slots drawn from the given half."""
    person, other = _pick(rng, _PEOPLE, heldout), _pick(rng, _PEOPLE, heldout)
    place, subject = _pick(rng, _PLACES, heldout), _pick(rng, _SUBJECTS, heldout)
    job, thing = _pick(rng, _JOBS, heldout), _pick(rng, _THINGS, heldout)
    dish, when = _pick(rng, _DISHES, heldout), _pick(rng, _TIMES, heldout)
    year = 2 * rng.randrange(850, 1010) + heldout  # even years train, odd years are held out
    count = _pick(rng, ["two", "three", "four", "five", "six", "seven"], heldout)
    templates = [
        f"{when}, {person} walked into {place} and",
        f"{person} had lived in {place} all her life, so when",
        f"It was raining when {person} first met {other} at {place}.",
        f"The story I want to tell you is about a {job} named {person}.",
        f"Hi {other},\n\nThank you for your message about",
        f"Dear {other},\n\nI hope this letter finds you well. I am writing because",
        f"To whom it may concern,\n\nMy name is {person}, and I have worked as a {job} for",
        f"Subject: Update on the {subject} project\n\nHello team,\n\n",
        f"Why does {subject} matter? For most of us,",
        f"Here is a simple explanation of how {subject} works.",
        f"Most people don't realise how much {subject} has changed since {year}.",
        f"{count.capitalize()} reasons to care about {subject}:\n\n1.",
        f"How to make {dish}\n\nIngredients:\n-",
        f"Making {dish} at home is easier than you might think. First,",
        f"A step-by-step guide to getting started with {subject}.\n\nStep 1:",
        f"In {year}, few people could have imagined that {subject}",
        f"{person} was born in {year} in {place}. As a child,",
        f"The life of a {job} is not what most people expect.",
        f"Review: {thing}\n\nI bought this {thing.split(' ', 1)[1]} last month, and",
        f"After a week with {thing}, here is what I think.",
        f"Local news: residents of {place} gathered on Saturday to",
        f"Good evening, everyone. Thank you all for coming tonight. When I became a {job},",
        f"Diary, {year}.\n\nToday was a strange day.",
        f"The best advice I ever got about {subject} came from a {job}.",
        f"Q: What should a beginner know about {subject}?\nA:",
        f"Summary: This article explains {subject} in plain language.\n\n",
        f"\"Are you sure about this?\" {person} asked.\n\n\"",
        f"If you have ever wondered about {subject}, you are not alone.",
        f"The first thing you notice about {place} is",
        f"{person} and {other} had been friends since school, but",
    ]
    return rng.choice(templates)
