from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("idem/", include("tests.testapp.views_idempotency")),
    path("aio/", include("tests.testapp.views_async")),
]
