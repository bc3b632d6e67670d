from orbit.cli import app

app()
