"""The WSGI entry point gunicorn serves (`app.wsgi:application`): JSON logs, then the app."""
from common import logs

from . import create_app

logs.configure("api")
application = create_app()
