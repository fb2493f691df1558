"""Generate our own OCR prompt set in the Flow-GRPO prompt format.

Each output line is one English prompt describing a scene, with exactly one double-quoted
span: the text the image must show, which the OCR reward compares against. The script writes
train.txt and test.txt next to itself. Every target text is used once across both files, so the
test split never rewards text the policy was trained on.

Run (from any directory; outputs land next to this file):  python examples/ocr/make_prompts.py
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SEED = 20240611
N_TRAIN = 600
N_TEST = 120
MAX_LEN = 30  # longest target we ask for; the paper's set tops out at the same length
OUT_DIR = Path(__file__).resolve().parent
CANDIDATES = 4  # target texts drawn per prompt; the rarest length among them is kept


def items(block: str) -> tuple[str, ...]:
    """Split a ';'-separated block into entries, so long vocabularies stay compact to read.

    Line breaks count as spaces, so an entry may wrap onto the next line.
    """
    return tuple(" ".join(s.split()) for s in block.split(";") if s.strip())


# ---------------------------------------------------------------------------------------------
# Vocabulary for the target texts. Hand lists give natural text; the generators further down
# combine them with numbers and names, so the pool is far larger than the prompts we need.
# Lists are split by register (shop signage, mottos, events...) so that each scene only gets
# text it would plausibly carry.
# ---------------------------------------------------------------------------------------------

SIGN_WORDS = items("""
Open; Closed; Exit; Bakery; Coffee; Books; Jazz; Pizza; Sushi; Tacos; Florist; Tattoo; Records;
Vintage; Barber; Pharmacy; Hotel; Motel; Diner; Bar; Pub; Cinema; Theater; Arcade; Garage;
Laundry; Market; Deli; Noodles; Ramen; Gelato; Donuts; Bagels; Tea; Wine; Cheese; Antiques;
Pottery; Yoga; Boxing; Karaoke; Bowling; Gallery; Museum; Library; Ferry; Taxi; Parking; Lobby;
Reception; Office; Private; Salon; Bistro; Surf; Tailor; Bikes; Vinyl; Pretzels; Sale; Push;
Pull; In; Out; Fresh; Organic; Espresso; Latte; Mocha; Waffles; Dumplings; Kebab; Optician;
Bookbinder; Hardware; Locksmith
""")

MOOD_WORDS = items("""
Welcome; Hello; Thanks; Dream; Hope; Love; Peace; Joy; Focus; Relax; Breathe; Explore; Create;
Wander; Believe; Sunday; Friday; Summer; Winter; Autumn; Midnight; Sunrise; Aurora; Echo; Nova;
Orbit; Comet; Galaxy; Thunder; Ocean; River; Forest; Meadow; Canyon; Glacier; Harvest; Honey;
Maple; Cocoa; Lemon; Mango; Cherry; Basil; Ginger; Vanilla; Go; Yes; No; Hi; OK; Up; Wow; Zoom;
Boom; Pow; Bingo; Climb; Wild; Home; Brave; Shine; Bloom; Drift; Spark; Gratitude
""")

NOTICES = items("""
Fresh Bread Daily; Mind the Step; Back in Five; Cash Only; No Vacancy; Rooms Available;
Ring Bell for Service; Please Knock; Staff Only; Wet Paint; Beware of Dog; Free Wi-Fi;
Open Till 2 AM; Closed on Mondays; Live Band on Saturday; Happy Hour 4 to 7; Kids Eat Free;
Order Here; Pick Up Here; Now Hiring; Under New Management; Everything Must Go;
Buy One Get One; Half Price Books; Daily Specials; Soup of the Day; Catch of the Day;
Chef's Choice; Homemade Pie; Ice Cold Lemonade; Hot Apple Cider; Fresh Eggs; Sweet Corn;
Pick Your Own; Farm Stand; Lost and Found; Quiet Please; Employees Only; Watch Your Head;
Thank You; Come Again; See You Soon; Out of Order; Sold Out; Kitchen Closes at 10;
Final Sale; Vacancy; Bike Repair; Fresh Flowers; Tea Time; Second Hand; Hot Soup; Open Late;
Walk-Ins Welcome; Dogs Welcome; No Dogs Allowed; Please Wait to Be Seated; Self Service;
Big Sale Today; Ask Inside; Back Soon; Out to Lunch; Gluten Free Options; Extra Spicy Wings;
Fresh Roasted Beans; Small Batch Ice Cream; Keys Cut While You Wait; Shoe Repair;
Alterations Done Here; Cold Drinks Inside; Closing Down Sale; Open Sundays
""")

MOTTOS = items("""
Slow Down; Good Morning; Good Vibes Only; Stay Curious; Be Kind; Dream Big; Make Art;
Drink More Water; Take It Easy; Plant More Trees; Save the Bees; Less Is More; Keep Going;
Hello Sunshine; Gone Fishing; Home Sweet Home; Top Secret; Vote Today; Recycle Me;
Made With Love; No Filter; Welcome Aboard; Bon Voyage; Just Married; Baby on Board;
Student Driver; Road Trip; Out Exploring; Free Compliments; Rainy Day Fund; Lucky Day; Stay Warm;
Eat More Greens; Very Important Cat; Night Owl; Early Bird; Choose Joy; Go Outside;
Read Every Day; Dance Anyway; Stay Hungry; Be Here Now; Ask Me Anything; Proud Plant Parent
""")

EVENT_PHRASES = items("""
Coming Soon; Now Showing; Tonight Only; Grand Opening; Open House; Yard Sale; Bake Sale;
Car Wash; Book Club; Chess Club; Art Show; Science Fair; Talent Show; Field Day; Movie Night;
Trivia Night; Taco Tuesday; Jazz Brunch; Poetry Slam; Night Market; Flea Market; Open Mic;
Sold Out Tonight; Quiz Night; Swap Meet; Cake Walk; Family Fun Day; Paint and Sip Night
""")

SLOGANS = items("""
Best Tacos on the Block; Coffee First, Questions Later; Good Food, Good Mood;
Life Is Better at the Lake; Made Fresh Every Morning; Ask Me About Our Pies;
Our Doors Are Always Open; Fresh Flowers Every Friday; Bikes Repaired While You Wait;
Home of the Giant Pretzel; Warm Socks for Cold Feet; Please Leave Your Shoes Here;
The Kettle Is Always On; Built to Last a Lifetime; Tomorrow Starts Tonight;
Nothing Beats Homemade; Rain or Shine We Are Open; Ten Minutes to the Beach;
No Bad Days at the Harbor; Ideas Grow Here; Small Town, Big Heart; Powered by Sunshine;
Fueled by Cold Brew; Stay Wild, Stay Kind; Hike More, Worry Less; Laughter Is Free Here;
Gardens Need Patience; Second Breakfast Served Here; The Best Seat in the House;
Every Cup Tells a Story; Where the Locals Eat; Cheaper Than Therapy; Always Bring a Snack;
Support Your Local Baker; Fix It, Don't Toss It; Ride the Slow Lane; Naps Are Productive;
The Night Is Still Young; Our Pizza Speaks for Itself; Free Refills All Day Long;
Dance Like Nobody Is Here; Sleep, Surf, Repeat; The Mountains Are Waiting;
Grandma Knows Best; Fresh Ideas Since Breakfast; Follow the Smell of Bread;
Better Together Since 1989; Handmade in Small Batches; The Sea Keeps Our Secrets;
Cats Rule This House; Kindness Is Always in Style; One More Chapter Please;
Loud Music, Soft Pretzels; Welcome to the Night Shift; Keep the Porch Light On;
Run Now, Pancakes Later; Thank You for Shopping Local; Today Is a Good Day to Fly;
Knit Happens Here; Dinner Is Served at Seven; Bring Your Own Mug;
Free Coffee With Every Repair; Open Every Day Except Tuesday; Fresh Bagels Out of the Oven;
Please Do Not Feed the Geese; The Best View Is Upstairs; All Dogs Get a Free Biscuit;
Last Chance for Gas and Snacks; Kindly Wipe Your Paws First; We Fix What Others Throw Away;
Hand-Pulled Noodles Made Daily; Your Neighborhood Record Store; Tomatoes Picked This Morning;
Good Coffee and Better Company; See You Next Summer, Friends; Music on the Patio Every Night;
Leave Only Footprints Here; Books, Coffee, and Quiet Hours; Proudly Serving the Valley;
Ice Cream Cures Most Things; Every Plant Deserves a Home; Adopt a Shelter Pet Today;
Slow Roasted, Fast Served; Bread Fresh From the Oven Now; Please Ring Twice for Service
""")

FIRST_NAMES = items("""
Maya; Leo; Ava; Omar; Priya; Kenji; Lucia; Tomas; Nadia; Elliot; Farah; Jonah; Ingrid;
Mateo; Zoe; Ravi; Clara; Idris; Hana; Felix; Amara; Sven; Rosa; Theo; Yuki; Dario; Noor;
Ezra; Mila; Kofi; Greta; Arjun; Lena; Malik; Iris; Bruno; Suki; Anya; Caleb; Wren; Elsa;
Hugo; Leila; Marco; Tess; Aiden; Beatriz; Chidi; Dana; Emil; Fiona; Gus; Hollis; Ines;
Jasper; Kira; Luca; Mirela; Nico; Olga; Paz; Quinn; Rhea; Silas; Tova; Uma; Vera; Walt;
Yara; Zane; Ada; Bo; Cyrus; Della; Esme; Fitz; Gwen; Hal; Isla; Joss
""")

SURNAMES = items("""
OKAFOR; LINDQVIST; MORENO; TANAKA; BRENNAN; KOWALSKI; NAKAMURA; FITZGERALD; ADEYEMI; SILVA;
HOLM; PETROV; CHEN; RAMIREZ; DUBOIS; O'NEILL; NOVAK; HARTMANN; SATO; ABERNATHY; QUINTERO;
VOSS; KAPOOR; MENSAH; ERIKSEN; ROSSI; IBARRA; WALSH; KIM; ZHANG; OYELARAN; DELACROIX;
MAGNUSSON; BAPTISTE; FERREIRA; SOKOLOV; MURPHY; ANDERSEN; HALVORSEN; ACHTERBERG
""")

PLACE_NOUNS = items("""
Bakery; Diner; Garage; Books; Kitchen; Tailoring; Bike Shop; Barbershop; Flowers; Noodle Bar;
Records; Hardware; Candy Shop; Taqueria; Laundromat; Pizzeria; Boutique; Cafe; Fish Market;
Ice Cream; Bagels; Tea House; Sweets; Greengrocer
""")

ODD_ADJECTIVES = items("""
Golden; Rusty; Hungry; Sleepy; Crooked; Blue; Silver; Lucky; Little; Wandering; Velvet;
Copper; Salty; Humble; Midnight; Jolly; Brave; Quiet; Wild; Paper
""")

ODD_NOUNS = items("""
Spoon; Anchor; Fox; Lantern; Kettle; Owl; Pelican; Teapot; Compass; Acorn; Bicycle; Whisk;
Otter; Thimble; Ladder; Heron; Moose; Walrus; Pickle; Sparrow
""")

SEASONS = items("Spring; Summer; Winter; Autumn; Weekend; Night")

PRODUCTS = items("""
Wild Flower Honey; Smoked Paprika; Roasted Almonds; Oat Milk; Extra Virgin Olive Oil;
Flaky Sea Salt; Chili Crisp; Crunchy Peanut Butter; Jasmine Green Tea; Dark Chocolate 70%;
Maple Pecan Granola; Dry Apple Cider; Spicy Tomato Ketchup; Red Lentils; Dijon Mustard;
Apricot Jam; Dill Pickles; Whole Bean Coffee; Dark Rye Bread; Ginger Ale; Basmati Rice;
Rolled Oats; Coconut Water; Sparkling Water; Lemon Soda; Hot Sauce; Black Pepper;
Ground Cinnamon; Vanilla Extract; Baking Soda; Brown Sugar; Tomato Soup; Lavender Soap;
Hand Cream; Sunscreen SPF 50; Cough Syrup; Dish Soap; Green Olives; Capers; Sardines; Pesto;
Tahini; Miso Paste; Kimchi; Soy Sauce; Penne Rigate; Plum Chutney; Pumpkin Seeds; Rose Water;
Mint Toothpaste; Cold Brew Concentrate; Blueberry Muffin Mix; Salted Caramel Sauce
""")

# Syllables for invented brand names: they look like brands but test OCR on letter sequences
# the text encoder has never seen as a word.
SYLLABLES = items("""
lu; mo; ra; ven; ta; ko; zi; bel; dor; ni; sa; vo; mi; ka; rin; el; tor; pa; shi; no; ar;
fen; lo; qui; dex; ma; ri; sol; ve; tu
""")

TOWN_STEMS = items("Maple; Ash; Stone; Clear; Red; Fox; Oak; Silver; Pine; Bright; Elm; Hollow")
TOWN_ENDS = items("ton; field; brook; ridge; ford; wood; haven; dale; port; water; mere; stead")

STREET_NAMES = items("""
Juniper; Harbor; Willow; Foundry; Orchard; Lantern; Canal; Chestnut; Quarry; Mill; Tanner;
Rosewood; Beacon; Kingfisher; Bramble; Heron; Cobalt; Marigold; Thistle; Ferry
""")
STREET_KINDS = items("Street; Avenue; Lane; Road; Way; Court; Place; Boulevard; Terrace; Row")

GREETINGS = items("""
Happy Birthday {name}; Congratulations {name}; Welcome Home {name}; Good Luck {name};
Happy Retirement {name}; Well Done {name}; Thank You {name}; Get Well Soon {name};
Happy {age}th Birthday; Happy Anniversary; Best Mom Ever; Best Dad Ever; Sweet Sixteen;
Happy Graduation {name}; Bon Voyage {name}; It's a Girl; It's a Boy; Love You {name}
""")

# Ages whose ordinal really ends in "th", so "Happy {age}th Birthday" stays correct English.
AGES = (*range(4, 21), 30, 40, 50, 60, 70, 80, 90)

EVENTS = items("""
Jazz Festival; Food Fair; Half Marathon; Film Festival; Book Fair; Summer Carnival; Harvest Fair;
Boat Parade; Art Walk; Chili Cookoff; Kite Festival; Farmers Market; Winter Lights; Pie Contest;
Street Party; Dog Show; Robot Contest; Lantern Walk
""")
DAYS = items("Friday; Saturday; Sunday; Weekend")

ROAD_SIGNS = items("""
STOP; YIELD; SLOW; DETOUR; ROAD CLOSED; NO PARKING; ONE LANE BRIDGE; DO NOT ENTER; WRONG WAY;
KEEP RIGHT; MERGE; NO U-TURN; BRIDGE ICES BEFORE ROAD; FALLING ROCKS; DEER CROSSING;
SCHOOL ZONE; END ROAD WORK; LANE CLOSED AHEAD; SHARE THE ROAD; TRUCKS USE LOW GEAR;
PEDESTRIAN CROSSING; LOOSE GRAVEL; SHARP CURVE AHEAD; NO OUTLET; FLOODED ROAD
""")

WARNINGS = items("""
DANGER; HIGH VOLTAGE; KEEP OUT; CREW MEMBERS ONLY; HELMETS REQUIRED; WET FLOOR;
NO ENTRY; CAUTION HOT SURFACE; THIN ICE; DEEP WATER; NO SWIMMING; FLAMMABLE; PRIVATE PROPERTY;
FORKLIFT CROSSING; EAR PROTECTION REQUIRED; LASER IN USE; DO NOT CLIMB; EYE WASH STATION;
FIRST AID; ASSEMBLY POINT; BEWARE OF FALLING ICE; STRONG CURRENTS; NO TRESPASSING
""")

SCREEN_TEXTS = items("""
Battery Low; Update Ready; Upload Complete; Access Denied; Welcome Back; Loading; Connecting;
Press Any Key; You Win; Level Up; Player One; Try Again; No Signal; Saved; Sent; Delivered;
Disk Full; Low Storage; Sync Complete; Focus Mode On; Airplane Mode; Password Incorrect;
Payment Approved; Out of Range; Pairing; Download Finished; New Message; Incoming Call;
Timer Done; Hello World; Add Credits; High Score; Continue?; Restart Required; Offline Mode;
Scan Your Card; Please Remove Card; Charging; Backup in Progress; Ready to Print
""")

NOTES = items("""
Buy Milk; Call Mom; Back at 3; Feed the Cat; Water the Plants; Pay Rent; Dentist Friday;
Don't Forget Keys; Gone to the Store; Pick Up Laundry; Meeting Moved; Dinner at 7;
Walk the Dog; Eggs, Flour, Butter; Return Library Books; Bring Umbrella; Fix Leaky Tap;
Ask About Tickets; Call the Plumber; Take Out Trash; Love You, See You Tonight
""")

MOVING_LABELS = items("""
FRAGILE; Careful, Dishes; This Side Up; Keep Dry; Do Not Stack; Perishable; Rush Delivery;
Open Other End; Glass Inside; Kitchen Stuff; Winter Clothes; Holiday Decorations;
Garage Tools; Misc.; Old Photos; Bathroom; Kids Room; Books, Heavy; Plates and Bowls;
Attic Junk; Craft Supplies; Spare Cables; Board Games
""")

AWARDS = items("""
1st Place; 2nd Place; 3rd Place; Best in Show; Employee of the Month; Most Improved; MVP;
Rookie of the Year; Lifetime Achievement; Spelling Bee Champion; Top Scorer;
Team Spirit Award; Best Chili; Fastest Lap; Coach of the Year; Perfect Attendance
""")

DRINKS = items("Oat Latte; Flat White; Iced Mocha; Chai; Cortado; Decaf; Matcha; Americano")

# ---------------------------------------------------------------------------------------------
# Target generators: one per kind of text a scene can plausibly show. Each takes the shared
# Random, so the whole output depends on SEED alone.
# ---------------------------------------------------------------------------------------------

# Plates skip I, O and Q as many real plate series do, which avoids 0/O and 1/I ambiguity.
PLATE_LETTERS = "ABCDEFGHJKLMNPRSTUVWXYZ"
PLATE_PATTERNS = ("LLL DDDD", "DLLLDDD", "LLDD LLL", "LLL-DDD", "DDD LLL", "LL DDDD", "LLLDDD")


def pick_fitting(rng: random.Random, options: tuple[str, ...]) -> str:
    # Generators that glue parts together can overshoot MAX_LEN; choose among those that fit.
    return rng.choice([o for o in options if len(o) <= MAX_LEN])


def number(rng: random.Random) -> str:
    # Favour 2-3 digits, but keep single digits and 4-digit numbers in the mix.
    digits = rng.choices((1, 2, 3, 4), weights=(1, 3, 3, 2))[0]
    return str(rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))


def price(rng: random.Random) -> str:
    dollars, cents = rng.randint(1, 99), rng.choice(("99", "50", "95", "25", "49", "00"))
    return rng.choice((f"${dollars}.{cents}", f"${dollars}", f"2 for ${dollars}", f"{dollars}¢"))


def clock(rng: random.Random) -> str:
    hour, minute = rng.randint(0, 23), rng.randint(0, 59)
    twelve_hour = f"{hour % 12 or 12}:{minute:02d} {'AM' if hour < 12 else 'PM'}"
    return rng.choice((f"{hour:02d}:{minute:02d}", twelve_hour))


def reading(rng: random.Random) -> str:
    return rng.choice(
        (
            f"{rng.randint(-15, 35)}°C",
            f"{rng.randint(10, 99)}°F",
            f"{rng.randint(1, 100)}%",
            f"{rng.randint(5, 80)} mph",
        )
    )


def plate(rng: random.Random) -> str:
    pattern = rng.choice(PLATE_PATTERNS)
    pick = {"L": lambda: rng.choice(PLATE_LETTERS), "D": lambda: rng.choice(string.digits)}
    return "".join(pick[c]() if c in pick else c for c in pattern)


def brand(rng: random.Random) -> str:
    return "".join(rng.choices(SYLLABLES, k=rng.randint(2, 3))).capitalize()


def odd_name(rng: random.Random) -> str:
    return f"{rng.choice(ODD_ADJECTIVES)} {rng.choice(ODD_NOUNS)}"


def shop(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"{rng.choice(FIRST_NAMES)}'s {rng.choice(PLACE_NOUNS)}"
    return f"The {odd_name(rng)}"


def town_name(rng: random.Random) -> str:
    return rng.choice(TOWN_STEMS) + rng.choice(TOWN_ENDS)


def title(rng: random.Random) -> str:
    # Book and film titles; invented, so no real work's title is asked for.
    return pick_fitting(
        rng,
        (
            f"The {odd_name(rng)}",
            f"{rng.choice(FIRST_NAMES)} and the {rng.choice(ODD_NOUNS)}",
            f"The Last {rng.choice(ODD_NOUNS)}",
            f"A {rng.choice(SEASONS)} in {town_name(rng)}",
            f"Letters from {town_name(rng)}",
            rng.choice(MOOD_WORDS),
        ),
    )


def label(rng: random.Random) -> str:
    product = rng.choice(PRODUCTS)
    # A brand prefix pushes labels towards the long end of the length range.
    return pick_fitting(rng, (product, f"{brand(rng)} {product}"))


def town(rng: random.Random) -> str:
    name = town_name(rng)
    return rng.choice(
        (
            name,
            f"Welcome to {name}",
            f"{name} Pop. {rng.randint(200, 9999):,}",
            f"Greetings from {name}",
        )
    )


def station(rng: random.Random) -> str:
    name = town_name(rng)
    return rng.choice((name, f"{name} Station", f"{name} Central", f"{name} Junction"))


def street(rng: random.Random) -> str:
    return f"{rng.choice(STREET_NAMES)} {rng.choice(STREET_KINDS)}"


def travel(rng: random.Random) -> str:
    letter = rng.choice("ABCDEFGH")
    return rng.choice(
        (
            f"Gate {letter}{rng.randint(1, 60)}",
            f"Flight {rng.choice(PLATE_LETTERS)}{letter}{rng.randint(100, 999)}",
            f"Check-in {rng.randint(1, 40)}",
            "Boarding",
            "Delayed",
            "On Time",
        )
    )


def transit(rng: random.Random) -> str:
    return rng.choice(
        (
            f"Platform {rng.randint(1, 14)}",
            f"Track {rng.randint(1, 9)}",
            f"Bus {rng.randint(1, 199)}",
            f"Line {rng.randint(1, 12)}",
        )
    )


def room(rng: random.Random) -> str:
    return rng.choice(
        (
            f"Room {rng.randint(100, 999)}",
            f"Suite {rng.randint(100, 999)}",
            f"Locker {rng.randint(1, 99)}",
            f"Unit {rng.randint(1, 40)}{rng.choice('ABCD')}",
        )
    )


def seat(rng: random.Random) -> str:
    letter = rng.choice("ABCDEFGHJK")
    return rng.choice(
        (
            f"Row {letter} Seat {rng.randint(1, 30)}",
            f"Seat {letter}{rng.randint(1, 30)}",
            f"Section {rng.randint(100, 340)}",
            "Admit One",
        )
    )


def year(rng: random.Random) -> str:
    y = rng.randint(1890, 2024)
    return rng.choice(
        (f"Est. {y}", f"Since {y}", f"Class of {y}", f"Founded {y}", f"Vintage {y}", f"{y}")
    )


def headline(rng: random.Random) -> str:
    # Event announcements are naturally long, which fills the 20-30 character end of the range.
    event, place = rng.choice(EVENTS), town_name(rng)
    return pick_fitting(
        rng,
        (
            f"{place} {event}",
            f"{event} This {rng.choice(DAYS)}",
            f"{place} {event} {rng.randint(2020, 2035)}",
            f"Annual {event}",
        ),
    )


def greeting(rng: random.Random) -> str:
    return rng.choice(GREETINGS).format(name=rng.choice(FIRST_NAMES), age=rng.choice(AGES))


def road(rng: random.Random) -> str:
    n = rng.randint(1, 99)
    return rng.choice(
        (
            rng.choice(ROAD_SIGNS),
            f"SPEED LIMIT {5 * (n % 14 + 2)}",
            f"EXIT {n}",
            f"ROUTE {n}",
            f"{town_name(rng).upper()} {n}",
        )
    )


def score(rng: random.Random) -> str:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return rng.choice((f"{a} - {b}", f"HOME {a} AWAY {b}", f"{a}:{b}", f"GUEST {10 * a + b}"))


def initials(rng: random.Random) -> str:
    a, b = rng.choices(string.ascii_uppercase, k=2)
    return rng.choice((f"{a}{b}", f"{a}.{b}.", f"{a} & {b}"))


def boat(rng: random.Random) -> str:
    return rng.choice(
        (odd_name(rng), f"Miss {rng.choice(FIRST_NAMES)}", f"{rng.choice(FIRST_NAMES)} II")
    )


def award(rng: random.Random) -> str:
    return rng.choice((rng.choice(AWARDS), f"Champions {rng.randint(1960, 2030)}"))


def cup_order(rng: random.Random) -> str:
    name = rng.choice(FIRST_NAMES)
    return rng.choice((name, f"{name}, {rng.choice(DRINKS)}"))


KINDS = {
    "char": lambda rng: rng.choice(string.ascii_uppercase + string.digits),
    "number": number,
    "price": price,
    "clock": clock,
    "reading": reading,
    "plate": plate,
    "sign_word": lambda rng: rng.choice(SIGN_WORDS),
    "mood_word": lambda rng: rng.choice(MOOD_WORDS),
    "notice": lambda rng: rng.choice(NOTICES),
    "motto": lambda rng: rng.choice(MOTTOS),
    "event": lambda rng: rng.choice(EVENT_PHRASES),
    "slogan": lambda rng: rng.choice(SLOGANS),
    "name": lambda rng: rng.choice(FIRST_NAMES),
    "surname": lambda rng: rng.choice(SURNAMES),
    "brand": brand,
    "odd_name": odd_name,
    "shop": shop,
    "title": title,
    "label": label,
    "town": town,
    "station": station,
    "street": street,
    "travel": travel,
    "transit": transit,
    "room": room,
    "seat": seat,
    "year": year,
    "headline": headline,
    "greeting": greeting,
    "road": road,
    "warning": lambda rng: rng.choice(WARNINGS),
    "screen": lambda rng: rng.choice(SCREEN_TEXTS),
    "note": lambda rng: rng.choice(NOTES),
    "moving": lambda rng: rng.choice(MOVING_LABELS),
    "score": score,
    "initials": initials,
    "boat": boat,
    "award": award,
    "cup": cup_order,
}

# ---------------------------------------------------------------------------------------------
# Scene wording. A prompt is: [framing] subject verb "TEXT" [lettering], detail, light[, finish].
# ---------------------------------------------------------------------------------------------

LIGHTS = {
    "outdoor": items("""
        in bright midday sun; at golden hour; under an overcast sky; in the soft blue light after
        sunset; on a drizzly afternoon; in crisp morning light; in light fog; under a clear winter
        sky; in dappled shade; with long evening shadows
    """),
    "indoor": items("""
        under warm tungsten light; in soft window light; under cool fluorescent tubes; lit by a
        single desk lamp; in diffused even light; in the glow of string lights; in dim
        candlelight; under bright overhead lights; in late afternoon sun through half-open blinds
    """),
    "night": items("""
        on a rainy night with reflections on the wet pavement; late at night; against a dark
        sky; in the deep blue of dusk; on a foggy evening; in the orange glow of streetlights;
        at midnight
    """),
    "general": items("""
        in soft natural light; in warm light; in bright, even light; in gentle side light; in
        moody low light; with crisp, hard shadows; in hazy morning light; in cool, overcast light
    """),
    "dim": items("""
        in a dark room lit only by the screen; in dim ambient light; in low blue light; under
        flickering overhead lights
    """),
    "studio": items("""
        in soft studio light; under a single softbox; in crisp product lighting; in gentle rim
        light; in soft diffused light; in warm spotlighting
    """),
}

# Used by scenes that do not name their own lettering.
LETTERING = items("""
in bold sans-serif capitals; in elegant serif type; in hand-painted brush lettering; in thin
minimalist type; in chunky retro letters; in flowing script; in blocky stencil letters; in
rounded playful letters; in condensed uppercase type; in gold lettering; in crisp white
letters; in bright red letters; in faded black letters
""")

FRAMINGS = items("""
A photograph of; A close-up photograph of; A realistic photo of; A detailed photo of;
A cinematic still of; A 35mm film photo of; A high-resolution photo of; A candid snapshot of;
A digital illustration of; A watercolor illustration of; A 3D render of; A Polaroid photo of;
An oil painting of
""")

FINISHES = items("""
shot on 35mm film; in photorealistic detail; with a shallow depth of field; in sharp focus;
in a muted film palette; with rich, saturated colors; captured in a wide establishing shot;
with a slight vignette
""")

# One block per scene. Subjects carry no article (with_article adds it), and every verb, detail,
# lettering and light of a scene is written to fit every subject of that scene. "lettering:
# none" marks media whose look is fixed by the subject itself; no lettering line means the
# generic LETTERING list.
SCENE_TABLE = """
subjects: painted wooden storefront sign; weathered shop sign above a doorway; backlit shop
  fascia; striped shop awning
verbs: reading; that reads; lettered with
kinds: shop; sign_word; brand
details: on a narrow cobblestone street; between a laundromat and a shuttered bookshop; with
  potted plants lining the window below; in a busy downtown block
light: outdoor

subjects: pink neon sign; flickering blue neon sign; neon sign in a bar window; buzzing red
  neon sign
verbs: glowing with; spelling out; that reads
kinds: sign_word; mood_word; notice; brand; shop
details: mounted on a dark brick wall; reflected in a puddle on the sidewalk; above the entrance
  of an all-night diner; casting a colored haze over the street
light: night
lettering: in looping cursive tubing; in bold glass-tube capitals; in thin glowing script

subjects: sidewalk chalkboard; café chalkboard menu; A-frame chalkboard sign
verbs: reading; chalked with; that says
kinds: notice; price; slogan
details: propped outside a small corner café; surrounded by doodles of coffee cups and leaves;
  leaning against a brick wall; next to a rack of bicycles
light: outdoor
lettering: in loose chalk handwriting; in colorful chalk lettering; in neat chalk capitals

subjects: hardcover book; paperback novel; cloth-bound notebook; worn leather journal
verbs: titled; whose cover reads; with a cover that says
kinds: title; mood_word
details: lying on a wooden café table beside a cup of tea; propped up on a bookstore display
  shelf; resting on a crumpled wool blanket; on top of a stack of older books
light: indoor

subjects: white cotton t-shirt; black graphic tee; faded vintage t-shirt; oversized gray
  sweatshirt
verbs: printed with; screen-printed with; bearing
kinds: motto; slogan; mood_word; year; town; headline
details: hanging on a wooden hanger against a white wall; folded on a boutique shelf; worn by
  someone waiting at a crosswalk; laid flat on a linen bedsheet
light: general

subjects: ceramic coffee mug; white enamel camping mug; chunky handmade mug; speckled
  stoneware mug
verbs: printed with; that says; decorated with
kinds: motto; slogan; mood_word; greeting
details: steaming on a kitchen windowsill; sitting on a cluttered office desk; next to a plate
  of cookies; held in two hands on a cold morning
light: indoor

subjects: concert poster; retro travel poster; movie poster; screen-printed gig poster
verbs: with the headline; reading; announcing
kinds: headline; event; title; town; year
details: pasted on a graffiti-covered wall; framed in a long hallway; peeling at the corners on
  a telephone pole; hanging in a subway station
light: general

subjects: car license plate; dusty license plate on an old pickup truck; embossed license
  plate; motorcycle license plate
verbs: reading; showing; that reads
kinds: plate
details: on the back of a parked vehicle; slightly bent at one corner; held by two rusty
  screws; splashed with dried mud
light: outdoor
lettering: in raised black characters; in reflective blue characters; in embossed capitals

subjects: frosted birthday cake; two-tier chocolate cake; rectangular sheet cake; lemon
  drizzle cake
verbs: decorated with; piped with; topped with
kinds: greeting; number; name
details: surrounded by lit candles; on a table covered in confetti; on a cake stand at a
  kitchen party; with a single sparkler on top
light: indoor
lettering: in pink icing; in swirling buttercream script; in chocolate lettering; in white icing

subjects: smartphone lock screen; laptop screen; smartwatch face; tablet screen
verbs: displaying; showing; with a notification reading
kinds: screen; clock; reading
details: on a cluttered desk; in someone's hand on a crowded train; next to a half-eaten
  sandwich; on a bedside table
light: indoor
lettering: in clean white system font; in bold dark text; in large glowing type

subjects: glass jar; mason jar; tin can; amber bottle
verbs: with a label reading; labeled; with a handwritten label reading; with a paper tag
  reading
kinds: label
details: on a pantry shelf; among rows of preserves; on a sunny kitchen counter; next to a
  wooden spoon
light: indoor

subjects: long vinyl banner; hand-painted cloth banner; festival banner; paper party banner
verbs: reading; that reads; announcing; spelling out
kinds: headline; event; slogan; greeting; town
details: strung between two lampposts; hanging above a school gymnasium stage; flapping in the
  wind over a market street; draped along a stone balcony
light: general

subjects: green highway sign; yellow road sign; red and white traffic sign; temporary orange
  road sign
verbs: reading; that reads; showing
kinds: road
details: beside a two-lane country road; at the edge of a mountain pass; over a busy
  interstate; half covered in snow
light: outdoor
lettering: in reflective white letters; in bold black capitals

subjects: football jersey; basketball jersey; hockey sweater; soccer shirt
verbs: printed with; bearing; stitched with
kinds: surname; number
details: hanging in a locker room; worn by a player mid-stride; framed behind glass in a
  sports bar; draped over a wooden bench
light: general
lettering: in block lettering across the back; in twill letters; in bright contrasting letters

subjects: cereal box; paper coffee bag; crinkly snack wrapper; tea tin; bar of soap in paper
  wrapping; cardboard shoe box
verbs: printed with; with packaging that reads; branded
kinds: brand
details: on a supermarket shelf; on a kitchen counter; next to a reusable shopping bag; beside
  a bowl of fresh fruit
light: studio

subjects: cardboard moving box; taped cardboard box; battered shipping carton
verbs: marked; scrawled with; labeled
kinds: moving
details: in an empty apartment hallway; on a moving truck ramp; at the bottom of a stairwell;
  on a warehouse floor
light: indoor
lettering: in thick black marker; in red stencil letters; in hurried handwriting

subjects: brass house number plaque; enamel door plate; painted mailbox; ceramic house number
  tile
verbs: showing; reading; marked
kinds: number; char
details: beside a blue front door; on a whitewashed wall; next to a climbing rose; by a wooden
  garden gate
light: outdoor
lettering: none

subjects: wooden letter tile; single keyboard key; giant marquee letter; oversized foam letter
verbs: showing; printed with; bearing
kinds: char
details: resting on a felt tabletop; lit from one side; among scattered paper clips; standing
  alone on a bare shelf
light: studio
lettering: none

subjects: train station sign; platform sign; railway station nameboard
verbs: reading; that reads; showing
kinds: station; transit
details: hanging above an empty platform; beside a waiting commuter train; at a rural stop
  with a wooden bench
light: outdoor

subjects: airport departure board; split-flap display; glowing LED departure screen
verbs: showing; reading; flipping to
kinds: travel; transit; clock; station
details: in a busy terminal hall; above a crowd of travelers; in a quiet station at dawn
light: general
lettering: in amber dot-matrix characters; in white split-flap letters

subjects: digital alarm clock; digital LED wall clock; car dashboard display; microwave
  display; digital thermostat
verbs: showing; reading; lit up with
kinds: clock; reading
details: in an otherwise dark room; with a faint reflection on its glass; surrounded by
  everyday clutter
light: general
lettering: in glowing red digits; in green seven-segment digits; in crisp white digits

subjects: shop window; glass café door; bakery window
verbs: with a vinyl decal reading; painted with; etched with
kinds: shop; notice; sign_word
details: reflecting the busy street outside; with pastries visible behind the glass; fogged
  slightly at the edges
light: outdoor
lettering: in gold leaf letters; in white vinyl script; in frosted capitals

subjects: graffiti mural; painted brick wall; concrete underpass wall; roll-down shop shutter
verbs: spray-painted with; tagged with; painted with
kinds: mood_word; slogan; brand; motto
details: under a railway bridge; in an alley lined with trash cans; beside a basketball court;
  at the end of a quiet side street
light: outdoor
lettering: in wildstyle letters; in bubbly spray-paint letters; in drippy neon paint; in huge
  blocky letters

subjects: street name sign; blue enamel street plaque; green street sign on a lamppost
verbs: reading; that reads
kinds: street
details: at a leafy intersection; on the corner of an old brick building; above a row of
  parked bicycles
light: outdoor
lettering: in white capitals; in classic serif letters

subjects: embroidered cushion; denim jacket patch; baseball cap; canvas tote bag; knitted
  beanie
verbs: embroidered with; stitched with; with a patch reading
kinds: mood_word; motto; initials; town; year
details: on a linen sofa; hanging on a coat hook; on a flea market table; resting on a wooden
  bench
light: general
lettering: in red thread; in gold thread; in chunky chain-stitch letters

subjects: silver ring; brass pocket watch; wooden cutting board; silver dog tag; pewter hip
  flask
verbs: engraved with; etched with; inscribed with
kinds: initials; name; year; mood_word
details: resting on a velvet cloth; on a weathered wooden surface; catching a glint of light;
  beside a small gift box
light: studio
lettering: in delicate script; in tiny serif capitals

subjects: paper takeaway coffee cup; iced coffee cup; compostable tea cup
verbs: marked with; scrawled with; labeled
kinds: cup
details: on a busy café counter; held up against a window; next to an open laptop
light: indoor
lettering: in black marker; in hurried handwriting

subjects: wooden town welcome sign; painted roadside sign; stone entrance sign
verbs: reading; that reads; carved with
kinds: town
details: at the edge of a quiet village; surrounded by wildflowers; beside a winding country
  lane
light: outdoor

subjects: gold trophy; engraved award plaque; bronze medal; glass award
verbs: engraved with; inscribed with; bearing
kinds: award
details: on a shelf of older trophies; in a glass display case; under a spotlight
light: indoor
lettering: none

subjects: handwritten price tag; cardboard price sign; supermarket shelf tag
verbs: reading; showing; marked
kinds: price
details: stuck into a crate of apples; pinned above a pile of lemons; on a rack of vintage
  coats; clipped to a bucket of tulips
light: general
lettering: in thick marker; in bold red numerals

subjects: food truck; ice cream van; hot dog cart
verbs: with a hand-painted sign reading; painted with; branded
kinds: odd_name; brand; notice
details: parked by a beach boardwalk; with a line of customers outside; at a night market
light: outdoor

subjects: roadside billboard; rooftop billboard; digital billboard
verbs: advertising; reading; with the slogan
kinds: slogan; brand; headline; event
details: above a highway; towering over a desert gas station; above a crowded intersection
light: outdoor

subjects: stretch of wet sand; sandy beach; smooth patch of sand
verbs: with the message; marked with
kinds: mood_word; name; greeting
details: as a wave rolls in; beside a pair of flip-flops; near a tide pool
light: outdoor
lettering: written with a stick; traced by a finger; spelled out in seashells

subjects: fogged bathroom mirror; frosted car window; steamy café window
verbs: with the message; marked with
kinds: mood_word; name
details: with droplets running down the glass; in an early morning chill
light: general
lettering: written with a fingertip; traced in the condensation

subjects: small plane towing a banner; blimp with a side banner; hot air balloon with a banner
verbs: that reads; reading
kinds: greeting; brand; slogan; headline; event
details: over a crowded beach; above a packed stadium; over a summer county fair
light: outdoor

subjects: sticky note; handwritten letter; index card; sheet of typewriter paper
verbs: that reads; reading; saying
kinds: note
details: stuck to a refrigerator door; on a cluttered desk; pinned to a corkboard; next to a
  pair of reading glasses
light: indoor
lettering: in uneven typewriter type; in neat handwriting; in messy ballpoint scrawl; in blue ink

subjects: stadium scoreboard; high school gym scoreboard; bowling alley score screen
verbs: displaying; showing; lit up with
kinds: score; number
details: above an empty court; during a packed evening game; over a muddy field
light: general
lettering: in bright yellow bulbs; in red LED digits

subjects: hotel room door; office door; storage unit door
verbs: with a plaque reading; marked; numbered
kinds: room; number; char
details: at the end of a carpeted hallway; in a quiet corridor; beside a potted fern
light: indoor
lettering: none

subjects: old cinema marquee; theater marquee; drive-in movie sign
verbs: announcing; spelling out; reading
kinds: title; event; headline
details: above a ticket booth; on a quiet main street; with a line of people underneath
light: night
lettering: in black slot-in letters; in bulb-lit letters

subjects: wine bottle; craft beer can; bottle of olive oil; glass bottle of soda
verbs: with a label reading; labeled; branded
kinds: brand; label; year
details: on a rustic dinner table; in a bucket of ice; on a wine shop shelf
light: indoor

subjects: leather luggage tag; paper luggage label; metal keychain tag
verbs: stamped with; printed with; marked
kinds: initials; name
details: attached to a worn suitcase; lying on a hotel reception desk; dangling from a backpack
light: general

subjects: bus stop sign; tram stop pole; bus destination sign
verbs: showing; reading; displaying
kinds: transit; station; number
details: at a windy street corner; beside a glass shelter; on a tree-lined avenue
light: outdoor
lettering: in orange LED letters; in bold white letters

subjects: set of wooden alphabet blocks; row of fridge magnet letters; line of cookie letters
verbs: spelling out; arranged to spell
kinds: mood_word; name
details: on a playroom rug; on a white refrigerator door; on a sheet of baking paper
light: indoor
lettering: none

subjects: forearm tattoo; small wrist tattoo; shoulder tattoo
verbs: reading; that reads; spelling
kinds: mood_word; name; motto
details: on someone resting their arm on a café table; freshly inked and slightly red; beside
  a faded rose design
light: general
lettering: in fine-line script; in bold traditional lettering; in tiny typewriter font

subjects: concert ticket; theater ticket; movie ticket stub
verbs: printed with; stamped with; reading
kinds: title; seat; number
details: held between two fingers; tucked into a wallet; lying on a dark wooden bar
light: indoor

subjects: yellow warning sign; hazard placard; safety sign on a chain-link fence
verbs: reading; that reads; with
kinds: warning
details: at a construction site; beside an electrical substation; at the edge of a frozen
  lake; next to a factory doorway
light: outdoor
lettering: in bold black capitals; in white letters on red

subjects: wooden fishing boat; white sailboat; rusty tugboat
verbs: named; with the name
kinds: boat
details: moored in a quiet harbor; pulled up on a pebble beach; rocking beside a wooden pier
light: outdoor
lettering: in gold letters along the stern; in peeling white paint

subjects: bumper sticker; laptop sticker; vinyl sticker on a water bottle
verbs: that says; reading; printed with
kinds: slogan; motto; mood_word
details: among a dozen other stickers; slightly peeling at one edge; faded by the sun
light: general

subjects: greeting card; handmade card; gift tag
verbs: reading; that says
kinds: greeting
details: propped against a vase of tulips; on top of a wrapped present; beside a ribbon and
  scissors
light: indoor
lettering: in gold foil script; in hand-drawn watercolor letters; in glitter letters

subjects: retro computer terminal; arcade cabinet screen; self-service kiosk
verbs: displaying; showing; flashing
kinds: screen
details: in a dim back room; in a noisy arcade; in an empty shopping mall
light: dim
lettering: in green monospaced text; in amber pixel letters; in blinking white text
"""


@dataclass(frozen=True)
class Scene:
    subjects: tuple[str, ...]
    verbs: tuple[str, ...]
    kinds: tuple[str, ...]
    details: tuple[str, ...]
    lights: tuple[str, ...]
    lettering: tuple[str, ...]


def parse_scene(block: str) -> Scene:
    # "key: value" starts a field; indented lines continue the previous one.
    fields = dict(re.findall(r"^(\w+): (.*(?:\n  .*)*)", block, flags=re.MULTILINE))
    lettering = fields.get("lettering", "")
    scene = Scene(
        subjects=items(fields["subjects"]),
        verbs=items(fields["verbs"]),
        kinds=items(fields["kinds"]),
        details=items(fields["details"]),
        lights=LIGHTS[fields["light"]],
        lettering=() if lettering == "none" else items(lettering) or LETTERING,
    )
    unknown = set(scene.kinds) - KINDS.keys()
    assert not unknown, f"unknown target kinds {unknown} in scene {scene.subjects[0]!r}"
    return scene


SCENES = tuple(parse_scene(block) for block in SCENE_TABLE.strip().split("\n\n"))


def with_article(noun: str) -> str:
    # Our subjects never start with a silent h, a 'you'-sounding u or a spelled-out
    # abbreviation such as LED, so the plain vowel rule is exact.
    return f"{'an' if noun[0].lower() in 'aeiou' else 'a'} {noun}"


def compose(rng: random.Random, sc: Scene, text: str) -> str:
    subject = with_article(rng.choice(sc.subjects))
    lettering = f" {rng.choice(sc.lettering)}" if sc.lettering and rng.random() < 0.6 else ""
    core = (
        f'{subject} {rng.choice(sc.verbs)} "{text}"{lettering}, '
        f"{rng.choice(sc.details)}, {rng.choice(sc.lights)}"
    )
    # Two sentence shapes, a framing first ("A photograph of ...") or the subject first with a
    # photographic finish, so the policy does not learn one fixed template.
    if rng.random() < 0.6:
        return f"{rng.choice(FRAMINGS)} {core}."
    return f"{core[0].upper()}{core[1:]}, {rng.choice(FINISHES)}."


def generate(rng: random.Random, total: int) -> list[tuple[str, str]]:
    """Return (target, prompt) pairs, each target unique ignoring case."""
    used: set[str] = set()
    length_counts: Counter[int] = Counter()
    pairs: list[tuple[str, str]] = []
    step = 0
    while len(pairs) < total:
        # Cycling through the scenes keeps them evenly represented.
        sc = SCENES[step % len(SCENES)]
        step += 1
        fresh = [
            text
            for text in (KINDS[rng.choice(sc.kinds)](rng) for _ in range(CANDIDATES))
            if text.casefold() not in used
        ]
        # A scene whose vocabulary is nearly spent (single characters) gives up its turn rather
        # than repeat a target; the other scenes fill the count.
        if not fresh:
            continue
        # Of the candidates, keep the one whose length is rarest so far: short texts are far
        # more common in the vocabulary, and this evens out the length spread.
        text = min(fresh, key=lambda t: length_counts[len(t)])
        used.add(text.casefold())
        length_counts[len(text)] += 1
        pairs.append((text, compose(rng, sc, text)))
    return pairs


def split(
    rng: random.Random, pairs: list[tuple[str, str]]
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Split into (train, test), stratified by target length so both cover the whole range."""
    every = len(pairs) // N_TEST
    assert every * N_TEST == len(pairs), "N_TRAIN + N_TEST must be a multiple of N_TEST"
    # generate() walks the scenes in order; shuffling first spreads scenes across both splits,
    # and the stable sort keeps that shuffled order within each length.
    rng.shuffle(pairs)
    by_length = sorted(pairs, key=lambda pair: len(pair[0]))
    test = by_length[::every]
    train = [pair for i, pair in enumerate(by_length) if i % every]
    # Undo the length ordering in the files themselves.
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def validate(train: list[tuple[str, str]], test: list[tuple[str, str]]) -> None:
    # Guards against vocabulary edits that would break the format the OCR reward parses.
    for text, prompt in train + test:
        assert 1 <= len(text) <= MAX_LEN, text
        assert prompt.count('"') == 2 and f'"{text}"' in prompt, prompt
        assert "\n" not in prompt and prompt == prompt.strip(), prompt
    assert not {t.casefold() for t, _ in train} & {t.casefold() for t, _ in test}
    assert len({p for _, p in train + test}) == len(train) + len(test)


def write(path: Path, pairs: list[tuple[str, str]]) -> None:
    path.write_text("".join(f"{p}\n" for _, p in pairs), encoding="utf-8", newline="\n")


def print_histogram(train: list[tuple[str, str]], test: list[tuple[str, str]]) -> None:
    train_len = Counter(len(t) for t, _ in train)
    test_len = Counter(len(t) for t, _ in test)
    print("target length histogram (chars: train test, one # per two prompts)")
    for n in range(1, MAX_LEN + 1):
        bar = "#" * -(-(train_len[n] + test_len[n]) // 2)  # rounded up, so no count shows empty
        print(f"{n:>3}: {train_len[n]:>4} {test_len[n]:>4}  {bar}")


def main() -> None:
    rng = random.Random(SEED)
    train, test = split(rng, generate(rng, N_TRAIN + N_TEST))
    validate(train, test)
    write(OUT_DIR / "train.txt", train)
    write(OUT_DIR / "test.txt", test)
    print(f"scenes: {len(SCENES)}, train.txt: {len(train)} prompts, test.txt: {len(test)} prompts")
    print_histogram(train, test)


if __name__ == "__main__":
    main()
