"""Labeled examples for "how should the assistant answer, given its tools?" (the ``tool-use`` task).

When2Call, the public set for this question, is a test set only, so the training rows
are generated: a user request and the tools the assistant has, written as When2Call
writes them (``{"name", "description", "parameters": {"type": "dict", "required",
"properties"}}``). Each of :data:`_TOOLS` is a tool with requests that give every
required argument and requests that leave one out. A row is labeled

- ``tool_call``: the request's own tool is listed and the request gives its required arguments;
- ``request_for_info``: the tool is listed but the request leaves a required argument out;
- ``cannot_answer``: none of the listed tools is the request's (complete or not).

So neither the wording nor the tool list alone gives the label away. The split is by
tool (seeded, 70% train, 15% dev, 15% test), and a row lists only tools of its own split:
the test split asks about tools that training never showed, a measure of transfer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from clef_guard.training.examples import WHEN_TO_CALL, Example, seeded_split

_VALUES: dict[str, list[str]] = {
    "city": ["Paris", "Tokyo", "Chicago", "Nairobi", "Lima", "Oslo", "Mumbai", "Toronto", "Austin", "Seoul"],
    "date": ["next Friday", "March 3", "tomorrow", "2024-07-15", "this Sunday", "the 21st of June"],
    "time": ["7:30 am", "noon", "6 pm", "8:15", "half past nine"],
    "n": ["two", "3", "four", "6", "five"],
    "email": ["ana@example.com", "raj.patel@corp.example", "team@studio.example", "li.wei@mail.example"],
    "message": ["the report is ready", "I'll be ten minutes late", "the launch moved to May", "thanks for the help"],
    "amount": ["250", "1,200", "45", "80", "3,000"],
    "currency": ["US dollars", "euros", "yen", "pounds", "Swiss francs"],
    "ticker": ["AAPL", "Tesla", "NVDA", "Microsoft", "AMZN"],
    "phrase": ["where is the train station", "good morning", "how much does this cost", "thank you very much"],
    "language": ["Spanish", "Japanese", "German", "Portuguese", "Korean"],
    "song": ["Bohemian Rhapsody", "Clair de Lune", "Shake It Off", "Hotel California"],
    "movie": ["Dune", "Inside Out 2", "Oppenheimer", "The Wild Robot"],
    "restaurant": ["Luigi's", "the Golden Dragon", "Café Rouge", "Sushi Zen"],
    "dish": ["a margherita pizza", "two pad thai", "a veggie burger and fries", "chicken tikka masala"],
    "place": ["the airport", "Union Station", "14 Elm Street", "the convention center", "my office"],
    "account": ["4471-0092", "CHK-5531", "88120934"],
    "name": ["my sister", "Carlos", "Mei", "my landlord", "Jordan"],
    "user": ["jsmith", "maria.k", "dev_ops_7", "t.nguyen"],
    "doctor": ["Dr. Alvarez", "Dr. Chen", "Dr. Okafor"],
    "tracking": ["1Z999AA10123456784", "TBA302918475", "LX449302817CN"],
    "ingredient": ["chickpeas", "salmon", "spinach", "leftover rice"],
    "team": ["Lakers", "Arsenal", "Yankees", "Chiefs"],
    "word": ["ephemeral", "sonder", "quixotic", "laconic"],
    "flight": ["UA 328", "BA117", "LH 400", "DL2045"],
    "order": ["#48213", "A-99127", "order 5521"],
    "chore": ["renew passport", "call the plumber", "buy birthday card"],
    "job": ["data analyst", "nurse", "backend developer", "graphic designer"],
    "number": ["12", "5.5", "300", "42"],
    "percent": ["4.5", "6", "3.2"],
    "years": ["15", "30", "5"],
}


@dataclass(frozen=True)
class _Tool:
    name: str
    description: str
    params: dict[str, str]
    """Parameter name to description; the first ``required`` of them are required."""
    required: int
    complete: tuple[str, ...]
    """Requests that give every required argument (``{slot}`` placeholders from :data:`_VALUES`)."""
    incomplete: tuple[str, ...]
    """Requests for the same thing that leave a required argument out."""

    def schema(self) -> dict[str, Any]:
        properties = {name: {"type": "string", "description": text} for name, text in self.params.items()}
        required = list(self.params)[: self.required]
        return {
            "name": self.name,
            "description": self.description,
            "parameters": {"type": "dict", "required": required, "properties": properties},
        }


def _tool(name: str, description: str, params: dict[str, str], complete: tuple[str, ...], incomplete: tuple[str, ...], *, required: int | None = None) -> _Tool:
    return _Tool(name, description, params, len(params) if required is None else required, complete, incomplete)


_TOOLS: tuple[_Tool, ...] = (
    _tool("get_weather", "Current weather and forecast for a city.", {"city": "City name.", "date": "Day of the forecast."},
          ("What's the weather in {city} {date}?", "Will it rain in {city} tomorrow?"), ("What's the weather going to be like?", "Do I need an umbrella today?"), required=1),
    _tool("book_flight", "Book a flight between two cities on a date.", {"origin": "Departure city.", "destination": "Arrival city.", "date": "Travel date."},
          ("Book me a flight from {city} to {city} on {date}.", "I need to fly {city} to {city}, leaving {date}."), ("Book me a flight to {city}.", "Get me on a flight {date}, please.")),
    _tool("search_hotels", "Find hotels in a city for given dates.", {"city": "City to stay in.", "check_in": "Check-in date.", "nights": "Number of nights."},
          ("Find a hotel in {city} from {date} for {n} nights.",), ("Find me a nice hotel for {n} nights.", "I need a hotel in {city}.")),
    _tool("reserve_table", "Reserve a restaurant table.", {"restaurant": "Restaurant name.", "time": "Reservation time.", "party_size": "Number of guests."},
          ("Reserve a table at {restaurant} for {n} at {time}.",), ("Can you book a table at {restaurant}?", "Book us a table for {n} tonight.")),
    _tool("send_email", "Send an email.", {"to": "Recipient address.", "body": "Message text."},
          ("Email {email} saying {message}.", "Send {email} a note that {message}."), ("Send an email saying {message}.", "Email {email} for me.")),
    _tool("convert_currency", "Convert an amount between currencies.", {"amount": "Amount to convert.", "from_currency": "Source currency.", "to_currency": "Target currency."},
          ("How much is {amount} {currency} in {currency}?", "Convert {amount} {currency} to {currency}."), ("Convert this to {currency} for me.", "What's the exchange rate today?")),
    _tool("get_stock_price", "Latest trading price of a stock.", {"ticker": "Stock symbol or company."},
          ("What's {ticker} trading at right now?", "Give me the share price of {ticker}."), ("How is my stock doing today?", "What's the stock price?")),
    _tool("translate_text", "Translate text into another language.", {"text": "Text to translate.", "target_language": "Language to translate into."},
          ("Translate '{phrase}' into {language}.", "How do you say '{phrase}' in {language}?"), ("Translate this into {language}.", "Can you translate '{phrase}'?")),
    _tool("set_alarm", "Set an alarm at a time.", {"time": "Alarm time.", "label": "Optional label."},
          ("Set an alarm for {time}.", "Wake me up at {time}."), ("Set an alarm for me.", "I need an alarm."), required=1),
    _tool("play_song", "Play a song by title.", {"title": "Song title."},
          ("Play {song}.", "Put on {song}, please."), ("Play that song I like.", "Play some music.")),
    _tool("get_showtimes", "Showtimes of a movie in a city.", {"movie": "Movie title.", "city": "City."},
          ("When is {movie} showing in {city}?",), ("When is the movie showing?", "What times is {movie} on?")),
    _tool("loan_payment", "Monthly payment of a loan.", {"principal": "Loan amount.", "rate": "Annual interest rate in percent.", "years": "Term in years."},
          ("What's the monthly payment on {amount} dollars at {percent}% over {years} years?",), ("What would my monthly loan payment be?", "Work out the payment on a {amount} dollar loan.")),
    _tool("create_event", "Add an event to the calendar.", {"title": "Event title.", "date": "Event date.", "time": "Start time."},
          ("Put '{chore}' on my calendar for {date} at {time}.",), ("Add a meeting to my calendar.", "Put '{chore}' on my calendar."), required=2),
    _tool("order_food", "Order food for delivery from a restaurant.", {"restaurant": "Restaurant name.", "items": "Dishes to order."},
          ("Order {dish} from {restaurant}.",), ("Order me some dinner.", "Get me something from {restaurant}.")),
    _tool("request_ride", "Request a car ride.", {"pickup": "Pickup address.", "destination": "Drop-off address."},
          ("Get me a ride from {place} to {place}.",), ("Call me a taxi.", "I need a ride to {place}.")),
    _tool("convert_units", "Convert a quantity between units.", {"value": "Quantity.", "from_unit": "Unit of the quantity.", "to_unit": "Target unit."},
          ("Convert {number} miles to kilometers.", "How many grams is {number} ounces?"), ("Convert that to kilometers.", "How many grams is that?")),
    _tool("get_balance", "Balance of a bank account.", {"account_id": "Account number."},
          ("What's the balance of account {account}?",), ("What's my balance?", "How much money do I have?")),
    _tool("send_money", "Send money to a contact.", {"recipient": "Who receives the money.", "amount": "Amount to send."},
          ("Send {amount} dollars to {name}.", "Transfer {amount} euros to {name}."), ("Send some money to {name}.", "Transfer {amount} dollars, please.")),
    _tool("reset_password", "Reset a user's password.", {"username": "Account user name."},
          ("Reset the password for user {user}.",), ("I forgot my password, reset it.", "Please reset my password.")),
    _tool("get_directions", "Directions between two places.", {"origin": "Start.", "destination": "End."},
          ("How do I get from {place} to {place}?",), ("How do I get there?", "Give me directions to {place}.")),
    _tool("book_appointment", "Book a doctor's appointment.", {"doctor": "Doctor's name.", "date": "Appointment date."},
          ("Book me with {doctor} on {date}.",), ("I need a doctor's appointment.", "Book me in with {doctor}.")),
    _tool("track_package", "Status of a parcel by tracking number.", {"tracking_number": "Carrier tracking number."},
          ("Where is my package {tracking}?", "Track {tracking} for me."), ("Where is my package?", "Has my parcel shipped yet?")),
    _tool("find_recipes", "Recipes that use an ingredient.", {"ingredient": "Main ingredient."},
          ("Find a recipe with {ingredient}.", "What can I cook with {ingredient}?"), ("Find me a recipe.", "What should I cook tonight?")),
    _tool("get_score", "Latest game result of a sports team.", {"team": "Team name."},
          ("Did the {team} win last night?", "What was the {team} score?"), ("Who won the game last night?", "What was the score?")),
    _tool("define_word", "Dictionary definition of a word.", {"word": "The word."},
          ("What does '{word}' mean?", "Define {word}."), ("What does this word mean?", "Look up a word for me.")),
    _tool("flight_status", "Whether a flight is on time.", {"flight_number": "Airline flight number."},
          ("Is flight {flight} on time?", "Has {flight} landed?"), ("Is my flight on time?", "Has my flight landed yet?")),
    _tool("local_time", "Current local time in a city.", {"city": "City name."},
          ("What time is it in {city}?",), ("What time is it over there?", "What's the local time?")),
    _tool("cancel_order", "Cancel an order by its id.", {"order_id": "Order id."},
          ("Cancel order {order}.", "Please cancel {order}."), ("Cancel my order.", "I want to cancel what I ordered.")),
    _tool("add_todo", "Add an item to the to-do list.", {"task": "What to do."},
          ("Add '{chore}' to my to-do list.", "Remind me to {chore}."), ("Add something to my to-do list.", "Put a task on my list.")),
    _tool("search_jobs", "Job openings by title and city.", {"title": "Job title.", "city": "City."},
          ("Find {job} jobs in {city}.",), ("Find me a job.", "Are there any {job} openings?")),
)
_PER_TOOL = 36
"""Rows generated per tool: a third of each label."""


def tool_use_examples(split: str) -> list[Example]:
    """The rows of ``split``; tools are assigned to train, dev and test by a seeded shuffle."""
    own = seeded_split("tool-use", _TOOLS, dev=0.15, test=0.15)[split]
    rng = random.Random(f"clef-guard/tool-use/{split}")
    examples = []
    for tool in sorted(own, key=lambda t: t.name):
        others = [t for t in own if t is not tool]
        for n in range(_PER_TOOL):
            label = ("tool_call", "request_for_info", "cannot_answer")[n % 3]
            complete = label == "tool_call" or (label == "cannot_answer" and n % 2 == 0)
            request = _fill(rng.choice(tool.complete if complete else tool.incomplete), rng)
            listed = rng.sample(others, rng.randint(0 if label == "cannot_answer" else 1, min(4, len(others))))
            if label != "cannot_answer":
                listed.insert(rng.randrange(len(listed) + 1), tool)
            state = {"messages": [{"role": "user", "content": request}], "tools": [t.schema() for t in listed]}
            examples.append(Example(f"{split}:{tool.name}:{n}", state, WHEN_TO_CALL, label))
    return examples


def _fill(template: str, rng: random.Random) -> str:
    """``template`` with each ``{slot}`` replaced by a value drawn for it (two same slots differ)."""
    out, rest = [], template
    used: set[str] = set()
    while "{" in rest:
        before, _, after = rest.partition("{")
        slot, _, rest = after.partition("}")
        value = rng.choice([v for v in _VALUES[slot] if v not in used])
        used.add(value)
        out += [before, value]
    return "".join(out) + rest
