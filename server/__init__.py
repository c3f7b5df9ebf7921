"""tandem's HTTP front end: the OpenAI-compatible server and the `tandem` command line."""

VERSION = "0.1.0"
