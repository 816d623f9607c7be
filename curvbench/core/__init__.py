"""The toolkit the components build on."""
