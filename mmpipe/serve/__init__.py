"""The serving engine and its HTTP front end (``mmpipe serve``)."""
