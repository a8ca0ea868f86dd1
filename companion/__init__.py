"""The paper companion: experiments, chapters' back-ends, demos; it imports ief's public names only."""
