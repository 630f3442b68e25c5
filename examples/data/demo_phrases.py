"""Phrase tables of make_demo_corpus.py: topics, sentence templates and small fact tables.

Templates take `{t}` (a topic), `{f}` (its field) and the names of `SLOTS`. Changing any entry
changes the generated files: rerun make_demo_corpus.py and commit its output with the change.
"""

# (topic, the field it belongs to); topics are singular: the templates say "it"
TOPICS = [
    ("renewable energy", "the environment"),
    ("regular exercise", "health"),
    ("remote work", "the workplace"),
    ("machine learning", "technology"),
    ("urban gardening", "city life"),
    ("the public library", "education"),
    ("electric mobility", "transport"),
    ("meditation", "mental health"),
    ("recycling", "the environment"),
    ("online privacy", "technology"),
    ("playing team sports", "childhood"),
    ("learning a second language", "education"),
    ("time management", "work"),
    ("healthy sleep", "health"),
    ("social media", "communication"),
    ("volunteering", "community life"),
    ("cloud computing", "business"),
    ("budgeting", "personal finance"),
    ("public transport", "city life"),
    ("3D printing", "manufacturing"),
    ("open-source software", "technology"),
    ("bird migration", "nature"),
    ("the water cycle", "nature"),
    ("the printing press", "history"),
    ("photosynthesis", "biology"),
    ("vaccination", "public health"),
    ("coral reef protection", "the ocean"),
    ("solar power", "energy"),
    ("composting", "gardening"),
    ("visiting museums", "culture"),
]

SLOTS = {
    "benefit": [
        "save time and money",
        "improve everyday life",
        "reduce waste",
        "make communities stronger",
        "open up new opportunities",
        "lower costs over time",
        "make complex tasks easier",
        "protect natural resources",
        "support long-term wellbeing",
    ],
    "group": [
        "families",
        "small businesses",
        "students",
        "older adults",
        "city planners",
        "researchers",
        "teachers",
        "local communities",
        "beginners",
        "farmers",
    ],
    "goal": [
        "plan ahead",
        "make better decisions",
        "stay healthy",
        "work more efficiently",
        "learn new skills",
        "save energy",
        "stay connected",
        "solve problems creatively",
        "use their resources wisely",
    ],
    "challenge": [
        "high upfront costs",
        "a lack of reliable information",
        "limited access in rural areas",
        "the time it takes to learn",
        "privacy risks",
        "changing regulations",
        "the need for regular maintenance",
        "uneven quality between providers",
    ],
    "claim": [
        "small, consistent changes tend to matter more than big one-time efforts",
        "the benefits grow when more people take part",
        "good results depend on clear goals and honest feedback",
        "the best approach usually depends on local conditions",
        "careful planning prevents most common mistakes",
        "public understanding is just as important as the technology itself",
    ],
    "example": [
        "a school might start a small pilot project before expanding it",
        "a family could track its spending for one month to find easy savings",
        "a city can measure results and adjust its plans each year",
        "a company may offer training so that every employee can take part",
        "a beginner can set aside twenty minutes a day to practice",
        "a neighborhood group might share tools and knowledge instead of buying everything new",
    ],
    "future": [
        "become even more common",
        "play a larger role in daily life",
        "become cheaper and easier to use",
        "shape the next generation of public policy",
        "inspire new kinds of jobs",
    ],
    "note": [
        "not every solution works for everyone",
        "the evidence is still developing in some areas",
        "costs and benefits can vary widely from place to place",
        "the choices of individuals add up over time",
        "the first results often take a few months to appear",
    ],
    "start": [
        "set a simple goal and review your progress every week",
        "read a few reliable sources and talk to people with experience",
        "begin with one small change and build on it",
        "make a short list of what matters most to you",
        "ask a local expert which first step fits your situation",
    ],
    "conclusion": [
        "careful choices can make a real difference",
        "technology and people work best together",
        "long-term thinking pays off",
        "small steps lead to lasting change",
        "curiosity and patience are rewarded",
    ],
}

OPENINGS = [
    "{t} has become an important part of {f}.",
    "{t} is one of the most discussed subjects in {f} today.",
    "When people talk about {f}, {t} often comes up.",
    "In recent years, {t} has changed the way we think about {f}.",
]
BODY = [
    "many people are interested in {t} because it can {benefit}.",
    "one of the main advantages of {t} is that it helps {group} {goal}.",
    "at the same time, {t} comes with challenges, such as {challenge}.",
    "experts often point out that {claim}.",
    "for example, {example}.",
    "in the long run, {t} may {future}.",
    "it is worth noting that {note}.",
    "to get started, {start}.",
    "another benefit is that it allows {group} to {goal}.",
    "critics mention {challenge}, but supporters argue that {claim}.",
    "studies of {f} suggest that {t} can {benefit} when it is done well.",
    "for {group}, the most practical question is how to {goal} without extra stress.",
    "this is especially true for {group}, who often want to {goal}.",
    "a common mistake is to ignore {challenge} until it becomes a serious problem.",
    "in practice, {example}.",
    "good information makes a big difference, since {claim}.",
    "some people worry about {challenge}.",
    "even so, {note}.",
    "{t} is not only about {f}; it also helps people {goal}.",
    "if you are new to {t}, {start}.",
]
CLOSINGS = [
    "overall, {t} shows how {conclusion}.",
    "in conclusion, {t} is worth understanding, because {conclusion}.",
    "in short, {t} matters for {f}, and {conclusion}.",
]

ESSAY_TASKS = [
    "write a short essay about {t}.",
    "explain why {t} matters for {f}.",
    "describe the benefits and drawbacks of {t}.",
    "what are the main advantages of {t}?",
    "explain the concept of {t} in simple terms.",
    "write a blog post about {t} for beginners.",
    "give an overview of {t} and its role in {f}.",
]
# Essay tasks with an input: the topic, or a sentence to expand.
TOPIC_INPUT_TASKS = [
    "Write a paragraph about the topic below.",
    "Write a short article on the following topic.",
]
EXPAND_TASKS = [
    "Expand the following sentence into a short paragraph.",
    "Develop the idea in this sentence into a few more sentences.",
]
SUMMARY_TASKS = [
    "Summarize the following text in one or two sentences.",
    "Summarize the main idea of this passage.",
    "Write a brief summary of the text below.",
]
TITLES = [
    "{t}: A Practical Guide",
    "Why {t} Matters",
    "{t} and the Future of {f}",
    "Getting Started with {t}",
]

ACTIVITIES = [
    "studying for exams",
    "working from home",
    "learning to cook",
    "saving money",
    "running a first marathon",
    "writing a novel",
    "starting a small business",
    "learning to play the guitar",
    "keeping a garden",
    "preparing for a job interview",
    "staying focused",
    "traveling on a budget",
]
TIP_TASKS = [
    "Give {n} tips for {a}.",
    "List {n} pieces of advice for {a}.",
    "What are {n} good habits for {a}?",
    "Suggest {n} ways to make {a} easier.",
]
TIPS = [
    (
        "Set clear goals",
        "Decide what you want to achieve and write it down, so you can measure your progress.",
    ),
    (
        "Start small",
        "Begin with a task you can finish today; early success makes it easier to continue.",
    ),
    (
        "Keep a schedule",
        "Doing the same thing at the same time each day turns effort into a habit.",
    ),
    ("Ask for feedback", "Other people notice problems that are hard to see from the inside."),
    (
        "Take regular breaks",
        "A short pause every hour keeps your attention sharp and prevents fatigue.",
    ),
    ("Track your progress", "A simple log shows what is working and what needs to change."),
    (
        "Stay organized",
        "Keep your materials in one place so you spend time on the task, not on searching.",
    ),
    ("Learn from mistakes", "Treat every setback as information about what to try next."),
    (
        "Find a partner",
        "Working with someone else keeps you accountable and makes the work more fun.",
    ),
    ("Celebrate small wins", "Recognizing progress, however small, keeps your motivation high."),
    ("Limit distractions", "Silence your phone and close unrelated tabs while you work."),
    ("Plan ahead", "Spend ten minutes each evening preparing for the next day."),
    (
        "Get enough rest",
        "Sleep and recovery are when your body and mind consolidate what you learned.",
    ),
    ("Review what works", "Once a month, look back and keep only the methods that helped."),
    ("Stay curious", "Asking why things work the way they do leads to better solutions."),
    ("Budget your time", "Estimate how long each step takes and add a margin for surprises."),
]
TIP_OUTROS = [
    "Good luck!",
    "Remember that consistency matters more than perfection.",
    "Pick two or three of these to start with rather than trying everything at once.",
]

PROCESSES = [
    (
        "make a cup of tea",
        [
            "Boil fresh water in a kettle.",
            "Warm the cup or teapot with a little hot water, then pour it out.",
            "Place a tea bag or a teaspoon of loose tea in the cup.",
            "Pour the hot water over the tea.",
            "Let it steep for three to five minutes, depending on how strong you like it.",
            "Remove the tea bag or strain the leaves.",
            "Add milk, lemon or honey if you like, and enjoy.",
        ],
    ),
    (
        "plant a tree",
        [
            "Choose a spot with enough sunlight and space for the tree's full size.",
            "Dig a hole two to three times as wide as the root ball and about as deep.",
            "Loosen the roots gently if they are circling the root ball.",
            "Place the tree in the hole so the top of the root ball is level with the ground.",
            "Fill the hole with the soil you removed and press it down lightly.",
            "Water the tree thoroughly.",
            "Spread a layer of mulch around the base, keeping it away from the trunk.",
        ],
    ),
    (
        "change a flat bicycle tire",
        [
            "Shift to the smallest gear and remove the wheel from the frame.",
            "Let out any remaining air and lever one side of the tire off the rim.",
            "Take out the old inner tube.",
            "Run your fingers inside the tire to find and remove whatever caused the flat.",
            "Inflate the new tube slightly and fit it inside the tire.",
            "Push the tire back onto the rim, taking care not to pinch the tube.",
            "Inflate the tire to the pressure printed on its side and put the wheel back on.",
        ],
    ),
    (
        "make pancakes",
        [
            "Whisk together 200 g of flour, a pinch of salt and two teaspoons of baking powder.",
            "In another bowl, beat two eggs with 300 ml of milk and 30 g of melted butter.",
            "Pour the wet ingredients into the dry ones and stir until just combined.",
            "Heat a lightly oiled pan over medium heat.",
            "Pour about a quarter cup of batter into the pan for each pancake.",
            "Cook until bubbles form on the surface, then flip and cook for another minute.",
            "Serve warm with fruit, syrup or yogurt.",
        ],
    ),
    (
        "back up a computer",
        [
            "Decide which files matter most: documents, photos, and project folders.",
            "Choose a backup location, such as an external drive or a cloud service.",
            "Use the backup tool built into your operating system to select the folders.",
            "Run the first full backup and let it finish completely.",
            "Schedule automatic backups, for example once a day.",
            "Test the backup by restoring one file to make sure it works.",
        ],
    ),
    (
        "write a cover letter",
        [
            "Read the job description carefully and note the most important requirements.",
            "Address the letter to a specific person if you can find their name.",
            "Open with one sentence that says which role you are applying for and why.",
            "In the middle paragraph, match two or three of your achievements to the requirements.",
            "Explain briefly why you want to work for this particular organization.",
            "Close by thanking the reader and saying you look forward to hearing from them.",
            "Proofread the letter, ideally after a break, before you send it.",
        ],
    ),
]
HOW_TO_TASKS = [
    "Describe how to {p}.",
    "Explain the steps to {p}.",
    "How do I {p}?",
    "Write step-by-step instructions to {p}.",
]
HOW_TO_INTROS = [
    "Here is how to {p}:",
    "Follow these steps to {p}:",
    "It is easier than it looks to {p}. The steps are:",
]
HOW_TO_OUTROS = [
    "That's it! With a little practice, it only takes a few minutes.",
    "Take your time on the first attempt; it gets quicker every time.",
]

# (instruction variants, [(input, label)]); the sentiment task answers with a sentence of its own
CLASSIFY = [
    (
        [
            "Classify the following animal as a mammal, bird or reptile.",
            "Is this animal a mammal, a bird or a reptile?",
            "Name the animal class of the following animal.",
        ],
        [
            ("Penguin", "Bird"),
            ("Dolphin", "Mammal"),
            ("Crocodile", "Reptile"),
            ("Eagle", "Bird"),
            ("Bat", "Mammal"),
            ("Turtle", "Reptile"),
            ("Whale", "Mammal"),
            ("Ostrich", "Bird"),
            ("Lizard", "Reptile"),
            ("Horse", "Mammal"),
            ("Owl", "Bird"),
            ("Iguana", "Reptile"),
            ("Elephant", "Mammal"),
            ("Parrot", "Bird"),
            ("Python", "Reptile"),
            ("Otter", "Mammal"),
        ],
    ),
    (
        [
            "Is the following food a fruit or a vegetable?",
            "Classify the following item as a fruit or a vegetable.",
        ],
        [
            ("Apple", "Fruit"),
            ("Carrot", "Vegetable"),
            ("Banana", "Fruit"),
            ("Spinach", "Vegetable"),
            ("Mango", "Fruit"),
            ("Broccoli", "Vegetable"),
            ("Cherry", "Fruit"),
            ("Potato", "Vegetable"),
            ("Pear", "Fruit"),
            ("Onion", "Vegetable"),
            ("Pineapple", "Fruit"),
            ("Cabbage", "Vegetable"),
            ("Grape", "Fruit"),
            ("Lettuce", "Vegetable"),
        ],
    ),
    (
        [
            "Classify the sentiment of the following sentence as positive, negative or neutral.",
            "What is the sentiment of this sentence?",
            "Decide whether the following review is positive, negative or neutral.",
        ],
        [
            ("I loved every minute of the concert.", "Positive"),
            ("The service was slow and the food was cold.", "Negative"),
            ("The meeting starts at ten o'clock.", "Neutral"),
            ("This is the best book I have read all year!", "Positive"),
            ("I waited two hours and nobody answered my call.", "Negative"),
            ("The store is on the corner of Main Street.", "Neutral"),
            ("Our new neighbors are incredibly kind.", "Positive"),
            ("The battery died after only one day.", "Negative"),
            ("The package arrived on Tuesday.", "Neutral"),
            ("The staff went out of their way to help us.", "Positive"),
            ("The instructions were confusing and incomplete.", "Negative"),
            ("The museum opens at nine.", "Neutral"),
        ],
    ),
]

# (country, capital, continent)
COUNTRIES = [
    ("France", "Paris", "Europe"),
    ("Japan", "Tokyo", "Asia"),
    ("Canada", "Ottawa", "North America"),
    ("Australia", "Canberra", "Oceania"),
    ("Brazil", "Brasília", "South America"),
    ("Egypt", "Cairo", "Africa"),
    ("Kenya", "Nairobi", "Africa"),
    ("Germany", "Berlin", "Europe"),
    ("India", "New Delhi", "Asia"),
    ("Mexico", "Mexico City", "North America"),
    ("Norway", "Oslo", "Europe"),
    ("Peru", "Lima", "South America"),
    ("Spain", "Madrid", "Europe"),
    ("Vietnam", "Hanoi", "Asia"),
    ("Argentina", "Buenos Aires", "South America"),
    ("Thailand", "Bangkok", "Asia"),
    ("Ghana", "Accra", "Africa"),
    ("Portugal", "Lisbon", "Europe"),
    ("New Zealand", "Wellington", "Oceania"),
    ("Chile", "Santiago", "South America"),
]
CAPITAL_TASKS = [
    "What is the capital of {c}?",
    "Name the capital city of {c}.",
    "Which city is the capital of {c}?",
]

# (instruction variants, [(input, output)])
EDITS = [
    (
        [
            "Correct the grammar in the following sentence.",
            "Fix the grammatical error in this sentence.",
            "Edit the sentence below so that it is grammatically correct.",
        ],
        [
            ("She don't like apples.", "She doesn't like apples."),
            ("Their going to the park tomorrow.", "They're going to the park tomorrow."),
            ("Me and him went to the store.", "He and I went to the store."),
            ("The list of items are on the table.", "The list of items is on the table."),
            ("I have went there twice.", "I have gone there twice."),
            ("Each of the students have a book.", "Each of the students has a book."),
            ("He runs more faster than his brother.", "He runs faster than his brother."),
            ("There is many reasons to stay.", "There are many reasons to stay."),
            ("We was happy with the result.", "We were happy with the result."),
            ("Its a beautiful day outside.", "It's a beautiful day outside."),
        ],
    ),
    (
        [
            "Rewrite the following sentence in a more formal tone.",
            "Make this sentence sound more professional.",
        ],
        [
            (
                "Gonna be late, traffic is crazy.",
                "I will be late because the traffic is very heavy.",
            ),
            (
                "Can you send me that stuff by Friday?",
                "Could you please send me the documents by Friday?",
            ),
            ("The new app is super cool.", "The new application is very impressive."),
            (
                "We can't make it to the meeting.",
                "Unfortunately, we are unable to attend the meeting.",
            ),
            ("Thanks a lot for the help!", "Thank you very much for your assistance."),
            (
                "The boss wants the report ASAP.",
                "The manager would like the report as soon as possible.",
            ),
            (
                "Sorry, I totally forgot to call you.",
                "I apologize for not calling you as promised.",
            ),
            ("Let's grab lunch and talk it over.", "Shall we discuss this over lunch?"),
        ],
    ),
    (
        [
            "Rewrite the following sentence in the passive voice.",
            "Change this sentence to the passive voice.",
        ],
        [
            ("The chef prepared the meal.", "The meal was prepared by the chef."),
            ("The committee approved the plan.", "The plan was approved by the committee."),
            ("A storm damaged the old bridge.", "The old bridge was damaged by a storm."),
            ("Students planted twenty trees.", "Twenty trees were planted by students."),
            (
                "The company will release a new model.",
                "A new model will be released by the company.",
            ),
            ("Volunteers cleaned the beach.", "The beach was cleaned by volunteers."),
        ],
    ),
]

LANGUAGES = ["French", "Spanish", "German"]
# (English, French, Spanish, German)
PHRASES = [
    ("Good morning", "Bonjour", "Buenos días", "Guten Morgen"),
    ("Thank you very much", "Merci beaucoup", "Muchas gracias", "Vielen Dank"),
    (
        "Where is the train station?",
        "Où est la gare ?",
        "¿Dónde está la estación de tren?",
        "Wo ist der Bahnhof?",
    ),
    (
        "I would like a coffee, please.",
        "Je voudrais un café, s'il vous plaît.",
        "Quisiera un café, por favor.",
        "Ich hätte gern einen Kaffee, bitte.",
    ),
    ("See you tomorrow", "À demain", "Hasta mañana", "Bis morgen"),
    (
        "How much does this cost?",
        "Combien ça coûte ?",
        "¿Cuánto cuesta esto?",
        "Wie viel kostet das?",
    ),
    ("Happy birthday", "Joyeux anniversaire", "Feliz cumpleaños", "Alles Gute zum Geburtstag"),
    (
        "The museum is closed on Mondays.",
        "Le musée est fermé le lundi.",
        "El museo cierra los lunes.",
        "Das Museum ist montags geschlossen.",
    ),
    ("Can you help me?", "Pouvez-vous m'aider ?", "¿Puede ayudarme?", "Können Sie mir helfen?"),
    (
        "I am learning to cook.",
        "J'apprends à cuisiner.",
        "Estoy aprendiendo a cocinar.",
        "Ich lerne kochen.",
    ),
]

CODE_TASKS = [
    "Write a Python function that {w}.",
    "Create a function in Python that {w}.",
    "Implement a Python function which {w}.",
]


CHARACTERS = [
    "a young baker",
    "an old lighthouse keeper",
    "a curious robot",
    "a shy student",
    "a retired teacher",
    "a clever fox",
    "a traveling musician",
]
PLACES = [
    "a small town by the sea",
    "a busy city full of bicycles",
    "a quiet village in the mountains",
    "a house at the edge of a forest",
]
EVENTS = [
    "found an old map in the attic",
    "received a letter with no name on it",
    "decided to learn something completely new",
    "discovered a garden that no one else could see",
    "lost the key to the town's only bridge",
]
LESSONS = [
    "asking for help is a sign of strength, not weakness",
    "the best adventures often begin close to home",
    "patience turns small efforts into big results",
    "kindness is remembered long after the details are forgotten",
]
STORY_TASKS = [
    "Write a short story about {c} who {e}.",
    "Tell a story in which {c} {e}.",
]
STORY_ROUTINES = [
    "Every morning, they walked the same path and greeted the same neighbors.",
    "Their days were calm and predictable, and they liked it that way.",
    "They kept a notebook of ideas that they never seemed to have time for.",
]
STORY_MIDDLE = [
    "At first, they were not sure what to do.",
    "They asked an old friend for advice, who listened carefully and smiled.",
    "The next few days were full of surprises.",
    "Some of the neighbors laughed, but a few offered to help.",
    "It rained for a week, and the plan had to change twice.",
    "Slowly, the pieces began to fit together.",
    "One evening, sitting by the window, they finally understood what the clue meant.",
    "When the day came, the whole town gathered to see what would happen.",
]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Keep answers short and accurate.",
    "You are a friendly tutor who explains things step by step.",
    "You are an assistant for a small company. Be polite and practical.",
]
FOLLOW_UPS = ["Thanks!", "Great, one more question.", "That helps.", "Next one:"]
PLANS = [
    'The user asks: "{t}" I should answer clearly and keep it well organized.',
    'The request is "{t}" A short, structured answer fits best.',
    "Task: {t} I will cover the main points without going on too long.",
]
