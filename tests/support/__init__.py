"""What tests share: test modules import from here (and conftest files provide fixtures), never from
another test module, so moving or deleting one test file cannot break another."""
