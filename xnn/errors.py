"""User-facing error types: the CLI prints these as one line, never a traceback."""


class XnnError(Exception):
    """Base class of errors caused by user input (files, configs, structures)."""


class InputError(XnnError, ValueError):
    """Invalid structure, array shape, cell or parameter."""


class DataFileError(XnnError, OSError):
    """A file that is missing, unreadable, or lacks the requested keys."""


class ModelFileError(XnnError):
    """A model file that is corrupt, truncated or incompatible."""


class UnknownSpeciesError(InputError):
    """A structure holds elements the model was not built for."""


class TrustError(ModelFileError):
    """A file that asks for trust the caller did not give (it would run code from a file)."""
