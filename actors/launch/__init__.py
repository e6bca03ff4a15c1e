"""Starting actors: embedded in one process, as services, as OS processes; a throwaway broker."""
