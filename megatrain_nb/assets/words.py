"""The answer words of the shipped chat set: numbers, opposites, colours (the conversations and
the preference pairs' near misses both draw on them)."""

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("day", "night"),
             ("old", "new"), ("open", "closed"), ("light", "dark"), ("full", "empty"), ("early", "late")]
COLOURS = [("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"), ("sun", "yellow"),
           ("blood", "red"), ("orange", "orange"), ("sea", "blue"), ("leaf", "green"), ("milk", "white")]
