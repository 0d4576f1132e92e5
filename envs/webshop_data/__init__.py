"""The WebShop fixture catalog (fixture/) and the script that writes it (make_fixture.py)."""
