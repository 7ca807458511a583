"""The pytest suite; ``tests.helpers`` holds what several test modules share."""
