"""One router per endpoint family; create_app includes them all."""
