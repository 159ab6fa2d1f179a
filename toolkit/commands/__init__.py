"""One module per `toolkit` subcommand; each only parses arguments and calls the library."""
